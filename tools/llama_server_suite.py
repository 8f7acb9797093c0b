"""llama.cpp's own server test suite, run against `kvsession serve`: how far kvsession is a drop-in for llama-server.

    .venv/bin/python tools/llama_server_suite.py                     # the default files, against qwen2.5-coder-0.5b
    .venv/bin/python tools/llama_server_suite.py unit/test_infill.py unit/test_tokenize.py
    .venv/bin/python tools/llama_server_suite.py -- -k n_probs -x    # after --: pytest's own arguments

The suite is `tools/server/tests/unit` of the llama.cpp inside llama-cpp-python 0.3.36 (its sdist carries the
whole source tree). Each test starts "llama-server" with its own flags (a context, slots, --metrics, an API key,
...) and talks to it over HTTP; here that binary is a shim that translates those flags into `kvsession serve`'s
(translate() below) and always serves MODEL, whatever model the test names. Of the suite's files only utils.py is
changed: its preset loader, which would download llama.cpp's test models, does nothing. Tests that assert what
llama.cpp's tiny test models write, or their token counts, cannot pass on another model; BENCHMARKS.md lists them.

Not part of `make test`: it starts a server per test (minutes in all; CPU-heavy, run it under `nice`). Needs
`make setup` first; the suite's own Python packages go into OUT/venv (pytest, requests, openai, prometheus-client,
as the suite's requirements.txt pins them).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

VERSION = "0.3.36"
DEFAULT_SOURCES = Path(f"/tmp/lserver/src/llama_cpp_python-{VERSION}/vendor/llama.cpp")
# The files of llama-server's routes that a text-only server with one model can answer; the rest need rerankers,
# LoRA, vision, a draft model, a model router, MCP or the web UI's tools.
DEFAULT_FILES = (
    "unit/test_basic.py", "unit/test_completion.py", "unit/test_infill.py", "unit/test_tokenize.py",
    "unit/test_ctx_shift.py", "unit/test_ignore_eos.py", "unit/test_chat_completion.py",
    "unit/test_compat_anthropic.py", "unit/test_compat_oai_responses.py", "unit/test_slot_save.py",
    "unit/test_metrics.py", "unit/test_template.py", "unit/test_security.py", "unit/test_embedding.py",
)
PACKAGES = ("pytest~=8.3.3", "requests~=2.32.3", "wget~=3.2", "filelock~=3.16", "openai~=2.14.0",
            "prometheus-client~=0.20.0")
ROOT = Path(__file__).resolve().parent.parent

# llama-server flags whose value kvsession takes under the same meaning, by kvsession's name
SAME = {"--port": "--port", "--temp": "--temp", "--seed": "--seed", "--threads": "--threads", "-t": "--threads",
        "--api-key": "--api-key", "--alias": "--alias", "-a": "--alias", "--slot-save-path": "--slot-save-path",
        "--chat-template-file": "--chat-template-file", "--chat-template": "--chat-template", "--tags": "--tags", "--batch-size": "--step-tokens",
        "-b": "--step-tokens", "--reasoning": "--reasoning", "--pooling": "--pooling"}
SAME_SWITCHES = {"--metrics": "--metrics", "--no-slots": "--no-slots", "--context-shift": "--context-shift",
                 "--verbose": "--verbose", "--no-ui": "--no-ui", "--no-webui": "--no-ui", "--embedding": "--embeddings",
                 "--embeddings": "--embeddings"}
# llama-server flags with nothing to change here (the GPU, the KV cache's type and layout, ...)
IGNORED = {"--n-gpu-layers", "-ngl", "--ubatch-size", "-ub", "-ctk", "-ctv", "-fa", "--reasoning-format",
           "--cache-ram", "--log-file", "--hf-repo", "--hf-file", "--model", "-m", "--model-url"}
IGNORED_SWITCHES = {"--jinja", "--no-jinja", "--cont-batching", "--kv-unified", "--swa-full",
                    "--slots", "--offline", "--no-cache-idle-slots", "--backend_sampling",
                    "--no-mmproj"}


class Unsupported(Exception):
    pass


def translate(args: list[str], model: str) -> list[str]:
    """llama-server's command line as `kvsession serve`'s. --ctx-size is the whole KV cache, shared by --parallel
    slots (each gets ctx/parallel, unless --kv-unified); kvsession's --ctx is each session's. A flag for
    something kvsession does not do (embeddings, LoRA, a draft model, ...) raises Unsupported."""
    out = ["serve", "-m", model, "--no-kv-disk"]  # llama-server keeps no prompt cache across restarts
    ctx = parallel = None
    unified = "--kv-unified" in args
    i = 0
    while i < len(args):
        flag = args[i]
        value = args[i + 1] if i + 1 < len(args) else None
        if flag in SAME:
            out += [SAME[flag], value]
        elif flag in SAME_SWITCHES:
            out.append(SAME_SWITCHES[flag])
            i -= 1
        elif flag in ("--ctx-size", "-c"):
            ctx = int(value)
        elif flag in ("--parallel", "-np"):
            parallel = int(value)
        elif flag in ("--n-predict", "-n"):
            if int(value) > 0:
                out += ["--max-tokens", value]
        elif flag == "--host":
            out += ["--host", value]
        elif flag == "--cors-origins":
            for origin in value.split(","):
                out += ["--cors", origin.strip()]
        elif flag == "--spec-type":
            out += ["--spec", "ngram" if value.startswith("ngram") else "off"]
        elif flag in IGNORED:
            pass
        elif flag in IGNORED_SWITCHES:
            i -= 1
        else:
            raise Unsupported(f"llama-server's {flag} has no kvsession counterpart")
        i += 2
    if parallel is not None:
        out += ["--parallel", str(parallel)]
    if ctx is not None:
        out += ["--ctx", str(ctx if unified or not parallel else ctx // parallel)]
    return out


def exec_kvsession(argv: list[str]) -> None:
    """The shim's work: become `kvsession serve` with the translated flags."""
    model, args = argv[0], argv[1:]
    try:
        serve = translate(args, model)
    except Unsupported as e:
        print(f"llama_server_suite: {e}", file=sys.stderr)
        sys.exit(2)
    kvsession = str(Path(sys.executable).with_name("kvsession"))
    print("llama_server_suite: " + " ".join([kvsession, *serve]), file=sys.stderr, flush=True)
    os.execv(kvsession, [kvsession, *serve])


def sources(given: Path | None, out: Path) -> Path:
    """llama.cpp's source tree: the one given, the lead's download, or one downloaded into OUT/src."""
    for d in (given, DEFAULT_SOURCES):
        if d is not None and (d / "tools/server/tests/utils.py").is_file():
            return d
    if given is not None:
        sys.exit(f"{given}: no tools/server/tests/utils.py there")
    src = out / "src"
    tree = src / f"llama_cpp_python-{VERSION}"
    if not tree.is_dir():
        src.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", str(src)], check=True)
        with tarfile.open(src / f"llama_cpp_python-{VERSION}.tar.gz") as t:
            t.extractall(src, filter="data")
    return tree / "vendor/llama.cpp"


def prepare(llama_cpp: Path, out: Path, model: str) -> Path:
    """OUT/venv with the suite's packages, a fresh copy of the suite (with the templates its tests read, at the same
    relative place), its utils.py's preset loader made a no-op, and the shim. Returns the suite's folder."""
    venv = out / "venv"
    if not (venv / "bin/python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin/pip"), "install", "--quiet", *PACKAGES], check=True)
    tree = out / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(llama_cpp / "tools/server/tests", tree / "tools/server/tests")
    shutil.copytree(llama_cpp / "models/templates", tree / "models/templates")
    tests = tree / "tools/server/tests"
    with open(tests / "utils.py", "a", encoding="utf-8") as f:
        f.write("\n\n# kvsession: every preset is served by one model, already installed; nothing to download\n"
                "ServerPreset.load_all = staticmethod(lambda: None)\n")
    shim = out / "llama-server"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} --exec {model} \"$@\"\n")
    shim.chmod(0o755)
    return tests


def summary(junit: Path) -> int:
    """Passed / failed / skipped per file, and each failure's first line; the number that failed."""
    per_file: dict[str, list[int]] = {}
    failures = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("classname", "").rsplit(".", 1)[-1] + ".py"
        counts = per_file.setdefault(name, [0, 0, 0])
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if case.find("skipped") is not None:
            counts[2] += 1
        elif bad is not None:
            counts[1] += 1
            failures.append(f"{name}::{case.get('name')}: {(bad.get('message') or '').splitlines()[0][:160]}")
        else:
            counts[0] += 1
    total = [sum(c[i] for c in per_file.values()) for i in range(3)]
    for name, (p, f, s) in sorted(per_file.items()):
        print(f"{name:<32} {p:>4} passed {f:>4} failed {s:>4} skipped")
    print(f"{'total':<32} {total[0]:>4} passed {total[1]:>4} failed {total[2]:>4} skipped "
          f"({total[0]} of {total[0] + total[1]} run)")
    print("\nfailures:" if failures else "")
    for line in failures:
        print("  " + line)
    return total[1]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--exec":
        exec_kvsession(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help=f"test files, as unit/test_X.py (default: {len(DEFAULT_FILES)} files)")
    p.add_argument("--llama-cpp", type=Path, help=f"llama.cpp's source tree (default: {DEFAULT_SOURCES}, else "
                   "downloaded into OUT/src)")
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="the model every test's server serves")
    p.add_argument("--out", type=Path, default=ROOT / "out/llama-suite", help="work folder (out/llama-suite)")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    tests = prepare(sources(args.llama_cpp, out), out, args.model)
    junit = out / "junit.xml"
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(out / "llama-server")}
    subprocess.run([str(out / "venv/bin/python"), "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider",
                    f"--junitxml={junit}", *(args.files or DEFAULT_FILES), *extra], cwd=tests, env=env)
    return 1 if summary(junit) else 0


if __name__ == "__main__":
    sys.exit(main())
