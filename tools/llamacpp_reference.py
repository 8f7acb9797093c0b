"""Write llama.cpp's reference vectors for a GGUF model, for the agreement tests.

Runs under a Python where llama-cpp-python is installed (see tools/README.md; it is
a developer tool, never needed by CI):

    python3 -m venv /tmp/peer
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/peer/bin/pip install llama-cpp-python==0.3.36
    /tmp/peer/bin/python tools/llamacpp_reference.py MODEL.gguf tests/vectors/NAME.json
    /tmp/peer/bin/python tools/llamacpp_reference.py --tiny tests/vectors/tiny.json
    /tmp/peer/bin/python tools/llamacpp_reference.py --hybrid tests/vectors/hybrid.json

For a real model it records: the token ids of TEXTS (special tokens parsed);
a teacher-forced pass over TEACHER_TEXT (at least 512 tokens) with the top-5
ids at every position; greedy continuations (up to 32 tokens, ending early at
an end-of-generation token) of PROMPTS. llama.cpp runs with an f32 KV cache,
kvsession's default: its own default (f16) moves this model's argmax at about
5% of the positions by itself. With --tiny it writes the tiny test
models of tests/tiny.py and records their full logits, with an f32 KV cache
so that float models can be compared at float precision, and the token ids
of TEXTS under each pre-tokenizer of TINY_PRE_TOKENIZER_SPECS. With --hybrid it
does the same for the hybrids' tiny models (TINY_HYBRID_SPECS), and records how
far llama.cpp's logits move when it takes the same tokens in several batches.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parent.parent

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll see what they've done.",
    "def add(a, b):\n    return a + b\n\n\nif __name__ == '__main__':\n\tprint(add(1, 2))  # -> 3\n",
    "   leading spaces, trailing spaces   \n\n\n  tabs\t\tand\r\nwindows line ends  ",
    "Café, naïve, façade, Zürich, São Paulo, Ångström, œuvre, Ελληνικά, русский язык",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 ❤️ 🇫🇷 and symbols ∑∫√∞ ≠ ≤ ½ ² ³",
    "Numbers 1234567890 3.14159 1e-10 0x1F 1,000,000 and dates 2026-11-29",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "URLs https://example.com/path?q=1&r=two#frag and e-mail someone@example.org",
    "",
    " ",
    "\n",
]

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "<|im_start|>user\nWhat is a KV cache in a transformer?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "Les trois couleurs du drapeau français sont",
]

TEACHER_TEXT = """\
A transformer generates text one token at a time. For every token it has already seen, each attention \
layer keeps a key vector and a value vector; together these form the KV cache. Without the cache the \
model would recompute the keys and values of the whole prefix at every step, and the cost of producing \
a reply would grow with the square of its length. With the cache, each new token costs one pass through \
the network plus one look at the stored rows.

The cache is also the most valuable state an inference server holds. A conversation of a few thousand \
tokens takes seconds to prefill on a small machine, but its cache can be written to disk in milliseconds \
and read back even faster. Saving the cache turns a long prefill into a short read: a user who returns \
to an old conversation, or an agent that resends its whole history with every request, can resume \
exactly where the model stopped, without recomputing a single token.

Doing this well asks for care. The file must say which model produced it, because the rows of one model \
mean nothing to another; it must carry the exact token ids, because the same text can tokenize in more \
than one way; and it must be written so that a crash in the middle never leaves a half-written file \
where a good one used to be.

    def save(session, path):
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(header(session))
            for layer in session.cache:
                f.write(layer.rows())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

| format        | header | checksums | crash-safe |
|---------------|--------|-----------|------------|
| raw blobs     | no     | no        | no         |
| session file  | yes    | yes       | yes        |

Les modèles de langue gardent en mémoire les clés et les valeurs de chaque jeton déjà lu. Die Sitzung \
wird auf die Festplatte geschrieben und später wieder geladen. 会話の履歴はディスクに保存できます。

In short: keep the history, check it before you trust it, and never pay twice for the same prefix. \
The numbers 1, 2, 3, 5, 8, 13, 21, 34 and 55 are the first Fibonacci numbers after zero, and 2026 is \
the year this sentence was written.
"""


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_eog(llm: Llama, token: int) -> bool:
    return bool(llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), token))


def greedy(llm: Llama, prompt: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    for _ in range(n):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if is_eog(llm, token):
            break
        out.append(token)
        llm.eval([token])
    return out


def real_model(model: str, threads: int) -> dict:
    llm = Llama(model_path=model, n_ctx=2048, n_batch=512, n_threads=threads, logits_all=True, verbose=False,
                type_k=0, type_v=0)  # f32 KV cache, like kvsession's default
    tok = lambda s: llm.tokenize(s.encode(), add_bos=False, special=True)  # noqa: E731
    tokenize = [{"text": t, "ids": tok(t)} for t in TEXTS]
    ids = tok(TEACHER_TEXT)
    if len(ids) < 512:
        sys.exit(f"teacher-forced text has only {len(ids)} tokens, need 512")
    llm.reset()
    llm.eval(ids)
    scores = np.asarray(llm.scores[: len(ids)])
    top5 = np.argsort(-scores, axis=1, kind="stable")[:, :5]
    greedy_runs = [{"prompt": p, "prompt_ids": tok(p), "continuation": greedy(llm, tok(p), 32)} for p in PROMPTS]
    return {
        "tokenize": tokenize,
        "teacher_forced": {"text": TEACHER_TEXT, "ids": ids, "top5": top5.tolist()},
        "greedy": greedy_runs,
    }


def tiny_models(threads: int) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import TINY_PRE_TOKENIZER_SPECS, TINY_REFERENCE_SPECS, TINY_SPLIT_TEXTS, TINY_TEXT, write_tiny  # noqa

    runs, splits = [], {}
    with tempfile.TemporaryDirectory() as d:
        for name, spec in TINY_PRE_TOKENIZER_SPECS.items():
            llm = Llama(model_path=str(write_tiny(os.path.join(d, "pre.gguf"), spec)), n_ctx=64, verbose=False)
            splits[name] = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=True)}
                            for t in TEXTS + TINY_SPLIT_TEXTS]
        for name, spec in TINY_REFERENCE_SPECS.items():
            path = write_tiny(os.path.join(d, f"{name}.gguf"), spec)
            llm = Llama(model_path=str(path), n_ctx=256, n_threads=threads, logits_all=True, verbose=False,
                        type_k=0, type_v=0)  # GGML_TYPE_F32 caches: compare floats at float precision
            ids = llm.tokenize(TINY_TEXT.encode(), add_bos=False, special=True)
            llm.eval(ids)
            logits = np.asarray(llm.scores[: len(ids)])
            runs.append({"name": name, "sha256": file_sha256(str(path)), "ids": ids,
                         "logits_f32_base64": base64.b64encode(logits.astype("<f4").tobytes()).decode()})
    return {"tiny": runs, "pre_tokenizers": splits}


def hybrid_models(threads: int) -> dict:
    """The hybrids' tiny models (tests/tiny.py TINY_HYBRID_SPECS): llama.cpp's logits on TINY_HYBRID_TEXT in one
    batch, and how far its own logits move when the same tokens go in several batches (SPLITS tokens at a time,
    each in a fresh context): the tolerance the tests hold ours to."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import TINY_HYBRID_SPECS, TINY_HYBRID_TEXT, write_tiny  # noqa

    runs = []
    with tempfile.TemporaryDirectory() as d:
        for name, spec in TINY_HYBRID_SPECS.items():
            path = str(write_tiny(os.path.join(d, f"{name}.gguf"), spec))

            def logits(step: int) -> tuple[list[int], np.ndarray]:
                llm = Llama(model_path=path, n_ctx=256, n_batch=256, n_ubatch=256, n_threads=threads,
                            logits_all=True, verbose=False, type_k=0, type_v=0)
                ids = llm.tokenize(TINY_HYBRID_TEXT.encode(), add_bos=False, special=True)
                for i in range(0, len(ids), step):
                    llm.eval(ids[i : i + step])
                return ids, np.asarray(llm.scores[: len(ids)], dtype=np.float32)

            ids, one = logits(256)
            split = {str(step): float(np.abs(logits(step)[1] - one).max()) for step in SPLITS}
            runs.append({"name": name, "sha256": file_sha256(path), "ids": ids, "split_max_abs_diff": split,
                         "logits_f32_base64": base64.b64encode(one.astype("<f4").tobytes()).decode()})
    return {"hybrid": runs, "splits": list(SPLITS)}


# how many tokens each batch of the split runs holds: one at a time (decode steps) and a few, not aligned
SPLITS = (1, 5, 7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", help="GGUF model file")
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--tiny", action="store_true", help="reference logits for the tiny test models instead")
    ap.add_argument("--hybrid", action="store_true", help="reference logits for the tiny hybrid models instead")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.tiny:
        data = tiny_models(args.threads)
    elif args.hybrid:
        data = hybrid_models(args.threads)
    else:
        if not args.model:
            ap.error("MODEL is required without --tiny")
        data = real_model(args.model, args.threads)
        data["model"] = {"file": os.path.basename(args.model), "sha256": file_sha256(args.model)}
    data["llama_cpp_python"] = llama_cpp.__version__
    data["command"] = " ".join(["python", "tools/llamacpp_reference.py", *sys.argv[1:]])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
