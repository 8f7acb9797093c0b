"""kvsession perplexity: llama-perplexity's chunking, checked against a plain computation and llama.cpp's figure."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvsession.cli import perplexity as ppl_module
from kvsession.cli.perplexity import perplexity
from kvsession.errors import KvsessionError

CORPUS = Path(__file__).parents[1] / "src" / "kvsession" / "bench" / "data" / "corpus.txt"
VECTOR = Path(__file__).parent / "vectors" / "perplexity.json"


def kvsession(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvsession", *map(str, args)], capture_output=True, text=True,
                          env=os.environ, timeout=timeout)


def plain_perplexity(engine, text: str, n_ctx: int) -> tuple[float, int]:
    """The definition, written out: each chunk in one forward pass over all of it, its second half scored."""
    tokens = engine.tokenizer.encode(text, special=False)
    nll, count = 0.0, 0
    for i in range(len(tokens) // n_ctx):
        chunk = tokens[i * n_ctx : (i + 1) * n_ctx]
        if engine.tokenizer.add_bos:
            chunk[0] = engine.tokenizer.bos_id
        cache = engine.session(max_tokens=n_ctx).cache
        logits = engine.model.forward(chunk, range(n_ctx), cache, all_logits=True).double()  # [n_ctx, vocab]
        lp = torch.log_softmax(logits, dim=-1)
        for j in range(n_ctx // 2, n_ctx - 1):
            nll -= float(lp[j, chunk[j + 1]])
            count += 1
    return math.exp(nll / count), count


@pytest.mark.parametrize("add_bos", [False, True])
def test_chunks_scored_as_llama_perplexity_does(tiny_engine, monkeypatch, add_bos):
    monkeypatch.setattr(tiny_engine.tokenizer, "add_bos", add_bos)
    monkeypatch.setattr(ppl_module, "SCORE_BATCH", 7)  # the scored half in several forward passes
    text = CORPUS.read_text(encoding="utf-8")[:1500]
    seen = []
    r = perplexity(tiny_engine, text, 64, on_chunk=lambda r: seen.append(r.running[-1]))
    expected, count = plain_perplexity(tiny_engine, text, 64)
    assert r.count == count == (r.n_tokens // 64) * 31  # positions 32..62 of each chunk
    assert r.ppl == pytest.approx(expected, rel=1e-5)
    assert seen == r.running and len(seen) == r.n_tokens // 64 and seen[-1] == r.ppl
    assert 0 < r.error < r.ppl


def test_a_limit_on_chunks_and_a_text_too_short(tiny_engine):
    text = CORPUS.read_text(encoding="utf-8")[:1500]
    assert len(perplexity(tiny_engine, text, 64, limit=2).running) == 2
    with pytest.raises(KvsessionError, match=r"needs at least 2048 \(two chunks\)"):
        perplexity(tiny_engine, text, 1024)


def test_the_command_prints_as_llama_perplexity(tiny_path, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(CORPUS.read_text(encoding="utf-8")[:1500])
    r = kvsession("perplexity", "-m", tiny_path, "-f", text, "--ctx", "64", "--precision", "f32", "-t", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].startswith("[1]") and lines[1].endswith(",") and "[2]" in lines[1]
    final = float(lines[1].rstrip(",").split(",")[-1].split("]")[1])
    assert lines[-1] == f"Final estimate: PPL = {final:.4f} +/- " + lines[-1].split("+/- ")[1]


@pytest.mark.parametrize("args, message", [
    (["-f", "{tmp}/none.txt"], "none.txt: no such file"),
    (["-f", "{tmp}"], "is a folder, not a file"),
    (["-f", "{tmp}/short.txt", "--ctx", "512"], "needs at least 1024 (two chunks)"),
])
def test_bad_input_is_one_line(tiny_path, tmp_path, args, message):
    (tmp_path / "short.txt").write_text("hello world")
    r = kvsession("perplexity", "-m", tiny_path, *[a.format(tmp=tmp_path) for a in args])
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr


@pytest.mark.slow
def test_smollm2_within_one_percent_of_llama_cpp(smollm2):
    """llama.cpp's figure on the same file, context and chunks, made with --peer-python (see the vector)."""
    v = json.loads(VECTOR.read_text())
    r = perplexity(smollm2, CORPUS.read_text(encoding="utf-8"), v["ctx"], limit=v["chunks"])
    assert r.n_tokens == v["n_tokens"]  # the same tokens
    assert abs(r.ppl / v["llama_cpp_ppl"] - 1) < 0.01, (r.ppl, v["llama_cpp_ppl"])
