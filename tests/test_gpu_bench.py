"""tools/gpu_bench.py and tools/gpu_check.sh, the device checks: a GPU is lent to few sessions and
for minutes, so the script must work the first time. Here it runs on the CPU with a small model: every figure
the GPU run reports is computed, rendered and written."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_bench_runs_end_to_end_on_the_cpu(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_bench.py"), "--out", str(tmp_path / "out"),
                          "--work", str(tmp_path / "work"), "--device", "cpu", "--small", "--skip-transformers",
                          "--keep-page-cache"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads((tmp_path / "out" / "gpu_bench.json").read_text())
    assert [s["context"] for s in r["sessions"]] == [256, 1024]
    for s in r["sessions"]:
        for key in ("bytes", "save_auto_s", "save_sync_s", "restore_auto_s", "restore_sync_s", "ttft_restored_s",
                    "ttft_recomputed_s", "save_vs_limit", "restore_vs_limit", "ttft_speedup"):
            assert s[key] > 0, key
    short, long = r["sessions"]
    assert long["bytes"] > short["bytes"]  # a session file grows with its context
    for s in r["sessions"]:  # the derived figures are the measured ones' ratios
        assert s["ttft_speedup"] == pytest.approx(s["ttft_recomputed_s"] / s["ttft_restored_s"])
        assert s["save_GBps"] == pytest.approx(s["bytes"] / 1e9 / s["save_auto_s"])
    assert r["ours"]["decode_graphs_tok_s"] > 0 and r["ours"]["decode_eager_tok_s"] > 0
    assert r["limits"]["disk_write_GBps"] > 0 and r["weight_bytes_per_token"] > 0
    assert set(r["streams_tok_s"]) == {"1", "4"} and all(v > 0 for v in r["streams_tok_s"].values())
    md = (tmp_path / "out" / "gpu_bench.md").read_text()
    assert "| 1,024 |" in md and "Decode tok/s" in md
    assert not any((tmp_path / "work").iterdir())  # session files and the disk probe are removed


def test_the_device_script_is_well_formed():
    assert subprocess.run(["bash", "-n", str(ROOT / "tools" / "gpu_check.sh")]).returncode == 0


def test_the_gpu_profile_runs_on_the_cpu(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_bench.py"), "--out", str(tmp_path),
                          "--work", str(tmp_path / "work"), "--device", "cpu", "--small", "--profile"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = (tmp_path / "profile.txt").read_text()
    assert "prefill 1024 tokens, chunks of 256" in text and "4 streams" in text and "aten::" in text
