"""Claude Code and Codex CLI themselves, from npm, against a server on Qwen2.5-Coder-1.5B.

Marked `agents` (and `slow`): it needs Node.js and the npm registry, where it
installs pinned versions of both clients into a cache folder
($KVSESSION_AGENTS_DIR, else ~/.cache/kvsession/agents) once, and the 1.5B
model (`make qwen-1.5b`; the 0.5B calls the wrong tools and loops). Without
them it skips, saying which is missing.

Each client runs non-interactively, as a user would script it: Claude Code
with `-p --output-format json --permission-mode acceptEdits --allowedTools
Write,Read,Bash` and its built-in tools cut to those three (`--tools`: a
3.4k-token first prompt instead of 11.3k, to keep the suite's time;
KVSESSION_AGENT_TOOLS=all gives it all of them), Codex
with `exec --skip-git-repo-check` and its defaults (8.6k tokens). For each:
the first turn exits 0 after a tool call came back to the server (a second
request within the run); the next turn (`claude -c`, `codex exec resume
--last`) reuses at least 95% of the turn before, live, then again from disk
after a restart; a new conversation in the same folder reuses its system
prompt and tools (90% of the first prompt); and no request got a 4xx or 5xx.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from server_proc import Server

pytestmark = [pytest.mark.agents, pytest.mark.slow]

CLIENTS = {"@anthropic-ai/claude-code": "2.1.332", "@openai/codex": "0.171.0"}
MODEL = "qwen2.5-coder-1.5b"
TURN_SECONDS = 900


@pytest.fixture(scope="module")
def bins() -> Path:
    """The clients' bin folder, installed once into the cache folder."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("the real agent clients need Node.js and npm (not found on PATH)")
    root = Path(os.environ.get("KVSESSION_AGENTS_DIR", Path.home() / ".cache" / "kvsession" / "agents"))
    root.mkdir(parents=True, exist_ok=True)
    want = [f"{name}@{version}" for name, version in CLIENTS.items()]
    stamp = root / "installed.json"
    if not stamp.exists() or json.loads(stamp.read_text()) != want:
        r = subprocess.run(["npm", "install", "--no-fund", "--no-audit", "--prefix", str(root), *want],
                           capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            pytest.skip(f"npm install of {' '.join(want)} failed (no npm registry?): {r.stderr[-500:]}")
        stamp.write_text(json.dumps(want))
    return root / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def model() -> Path:
    from kvsession.engine import model_path
    from kvsession.errors import KvsessionError

    try:
        return model_path(MODEL)
    except KvsessionError:
        pytest.skip(f"{MODEL} is not installed: make qwen-1.5b")


@pytest.fixture()
def server(model, tmp_path):
    # greedy where a client names no temperature (neither does): the same turns every run
    s = Server(model, tmp_path, "--kv-disk-dir", tmp_path / "kv", "--trace", tmp_path / "trace.jsonl", "--temp", 0)
    s.tmp = tmp_path
    yield s
    s.stop()


def trace(server) -> list[dict]:
    path = server.tmp / "trace.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def turn(server, argv: list[str], env: dict, cwd: Path) -> list[dict]:
    """Run one client command to its end; returns the trace lines of its requests."""
    before = len(trace(server))
    r = subprocess.run(argv, env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True,
                       timeout=TURN_SECONDS, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    lines = trace(server)[before:]
    assert lines, "the client sent no request"
    return lines


def no_errors(server) -> None:
    """No request got a 4xx or 5xx (but the start-up's /health polls, 503 until the model is loaded)."""
    statuses = re.findall(r'"[A-Z]+ /(?!health)\S* HTTP/1.1" (\d{3}) ', Path(server.log.name).read_text())
    assert statuses and not [s for s in statuses if s[0] in "45"], statuses


def reuse(line: dict, previous: dict) -> float:
    return line["reused_tokens"] / (previous["prompt_tokens"] + previous["completion_tokens"])


def report(name: str, turns: dict[str, list[dict]]) -> None:
    """The figures BENCHMARKS.md quotes (pytest -s shows them): each turn's first request."""
    print(f"\n{name}: turn, source, prompt tokens, reused, time to first token")
    for what, lines in turns.items():
        x = lines[0]
        print(f"  {what:<28} {x['source']:<5} {x['prompt_tokens']:>7,} {x['reused_tokens']:>7,} "
              f"{(x['first_token_ms'] or 0) / 1e3:>8.2f} s   ({len(lines)} requests)")


def conversation(server, first, again, fresh, env, cwd, name):
    """first turn, the next turn live, again from disk after a restart, and a new conversation."""
    one = turn(server, first, env, cwd)
    assert len(one) >= 2, one  # a tool call reached the client, and its result came back
    two = turn(server, again, env, cwd)
    assert two[0]["source"] == "live" and reuse(two[0], one[-1]) >= 0.95, (one[-1], two[0])
    server.stop()
    server.start()
    three = turn(server, again, env, cwd)
    assert three[0]["source"] == "disk" and reuse(three[0], two[-1]) >= 0.95, (two[-1], three[0])
    four = turn(server, fresh, env, cwd)
    report(name, {"first turn (cold)": one, "next turn (live)": two, "next turn after a restart": three,
                  "a new conversation": four})
    assert four[0]["reused_tokens"] >= 0.9 * one[0]["prompt_tokens"], (one[0], four[0])
    no_errors(server)


def test_claude_code(bins, server, tmp_path):
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir(), project.mkdir()
    env = {"HOME": str(home), "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "dummy"}
    tools = [] if os.environ.get("KVSESSION_AGENT_TOOLS") == "all" else ["--tools", "Write,Read,Bash"]
    base = [str(bins / "claude"), "--model", MODEL, "--output-format", "json", "--permission-mode", "acceptEdits",
            "--allowedTools", "Write,Read,Bash", *tools, "-p"]
    conversation(server, base + ["Create a file hello.txt containing hi"],
                 base[:-1] + ["-c", "-p", "What did you just do?"],
                 base + ["Create a file bye.txt containing bye"], env, project,
                 f"Claude Code {CLIENTS['@anthropic-ai/claude-code']}, {'all its' if not tools else 'three'} tools")
    assert (project / "hello.txt").read_text().strip() == "hi"


def test_codex(bins, server, tmp_path):
    home, project = tmp_path / "codex", tmp_path / "project"
    home.mkdir(), project.mkdir()
    (home / "config.toml").write_text(f'model = "{MODEL}"\nmodel_provider = "kvsession"\n\n'
                                      '[model_providers.kvsession]\nname = "kvsession"\n'
                                      f'base_url = "{server.url}/v1"\nwire_api = "responses"\n')
    env = {"HOME": str(home), "CODEX_HOME": str(home)}
    codex = [str(bins / "codex"), "exec", "--skip-git-repo-check"]
    conversation(server, codex + ["Create a file hello.txt containing hi"],
                 [str(bins / "codex"), "exec", "resume", "--last", "--skip-git-repo-check", "What did you just do?"],
                 codex + ["List the files here"], env, project, f"Codex CLI {CLIENTS['@openai/codex']}")
