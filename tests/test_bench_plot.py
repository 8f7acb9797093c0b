"""kvsession bench --plot: the picture of save, restore and recompute time and of speed against context."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvsession.bench.engine import check_plot_target, plot
from kvsession.errors import KvsessionError

PNG = b"\x89PNG\r\n\x1a\n"


def rows(peer: bool) -> list[dict]:
    out = []
    for ctx in (256, 512, 1024):
        r = {"ctx": ctx, "prefill_tps": 600.0, "decode_tps": 70.0, "save_ms": ctx / 100, "load_ms": ctx / 200}
        if peer:
            r |= {"peer_prefill_tps": 300.0, "peer_decode_tps": 100.0, "peer_save_ms": ctx / 40,
                  "peer_load_ms": ctx / 150}
        out.append(r)
    return out


@pytest.mark.parametrize("peer", [False, True])
def test_plot_writes_a_png(tmp_path, peer):
    path = tmp_path / "bench.png"
    plot(rows(peer), str(path), "tiny")
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000


@pytest.mark.parametrize("name, message", [("x.txt", "name a .png, .svg, .pdf file"),
                                           ("folder.png", "is a folder, not a file"),
                                           ("none/x.png", "no folder")])
def test_a_bad_target_is_refused_before_measuring(tmp_path, name, message):
    (tmp_path / "folder.png").mkdir()
    with pytest.raises(KvsessionError, match=message):
        check_plot_target(str(tmp_path / name))


def test_bench_plot_on_the_tiny_model(tiny_path, tmp_path):
    path = tmp_path / "b.png"
    r = subprocess.run([sys.executable, "-m", "kvsession", "bench", "-m", str(tiny_path), "--contexts", "32,64",
                        "--repeat", "1", "--decode-tokens", "2", "--no-peer", "--plot", str(path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"wrote {path}" in r.stdout and path.read_bytes()[:8] == PNG
