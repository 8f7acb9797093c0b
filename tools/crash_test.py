"""Crash testing of `kvsession serve` and its disk cache: SIGKILL at chosen moments under traffic, then checks.

    nice -n 10 .venv/bin/python tools/crash_test.py --minutes 45 [--kills N] [--dir /tmp/kvsession-crash]
        [--seed 0] [--model GGUF] [--out summary.json]
    .venv/bin/python tools/crash_test.py --clean --kills 6    # the control: SIGTERM restarts, no kill

A server (a tiny random-weight model of tests/tiny.py with a 2048-token
context, unless --model; float32 weights and KV rows) runs with a 1 MB disk
cache (--kv-disk-space-mb 1), 16-token chunks and a live budget of 1 MB, so
that checkpoints, evict-saves and the disk's evictions happen all the time,
under 4 conversations growing a turn at a time together, a named-session
save and a stored response (the Responses API) each round. Every cycle
picks a target (in turn) and the server is killed inside it:

    chunk, manifest      a chunk's or a manifest's file, whatever checkpoint writes it
    evict, shutdown      any file of an "evict" checkpoint (a live session leaving memory), or of the
                         "shutdown" checkpoints after SIGTERM
    session, response    a named session's file, a stored response's file
    disk-eviction        the store removing a checkpoint's files to keep its budget
    random               no hook: SIGKILL at a random moment of the traffic

at a stage of the write: `create` (its temporary file just made), `mid` (a
random 0-2 ms after that: while the bytes go out) or `commit` (written,
before the rename that puts it in place); a disk eviction at a `remove`. The
hook is Python's audit hook (sys.addaudithook, installed by this program
in the server's process before kvsession starts: no code of kvsession's is
changed): it sees the open, rename and remove of every file, tells from the
call stack what is being written and why, counts, and SIGKILLs its own
process at the target's n-th occurrence (n from 1 to 3), after appending
where it landed to a log. A cycle whose target does not come up in its
rounds is killed at once after them (counted as `not reached`).

After every kill, before the restart: `kvsession cache verify` on a copy of
the cache folder (the server restarts on the folder as the kill left it).
After the restart: the first request answered; every conversation's next
turn (greedy, 8 tokens, with the top-5 log-probabilities) either restored
from disk or a miss, and compared with the turn a server without a disk
cache gives (a second server, never killed, --no-kv-disk): the same reply,
or a near tie flipped (every log-probability of both top-5s within TIE of
the other's, up to the first token that differs: a row computed in another
batch split differs in its last bits), never another distribution; every
named session whose save was answered 200 restores whole (its token count
one that a save was given); every stored response answered 200 reads back
the same; the cache folder within its budget; no temporary file left after
the restart's first requests.

The histories carry a canned assistant turn ("Noted, turn N."), as
clients that rewrite replies do, by default: a server matches a prompt to
a live session or a checkpoint by its rendered text as well as by tokens
(ds4's match), so a history carrying the model's own reply reuses the rows
of the tokens the model generated, which are not always the tokens the
reply's text encodes to (a random model's lone byte tokens come back from
the client as U+FFFD; a real model's reply may tokenize another way): the
reply then follows the live session's state, not a cold prefill's, restart
or none. `--replies generated` keeps the model's replies in the histories
and so measures that too (a divergence there says which of the two).

Prints a summary and writes it as JSON (--out). Exit status 1 on any wrong
restore, lost session or response, verify failure (damaged or dangling), a
first request not answered or a folder over budget.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "You are a patient assistant. Answer each question in one short line, plainly. "
TOPICS = ["the sea", "the hills", "a city at night", "an old clock", "the rain", "a long road", "winter bread",
          "a small boat", "the northern lights", "a garden wall", "a train station", "a river delta"]
TARGETS = ["chunk", "manifest", "evict", "shutdown", "session", "response", "disk-eviction", "random"]
STAGES = ["create", "mid", "commit"]
# log-probabilities closer than this (nats) are the same distribution: a KV row computed in another batch
# split differs in its last bits, which flips a near tie of a random model's greedy choice; a wrong restore
# (another conversation's rows, stale or torn ones) moves them by far more
TIE = 0.05


# --- in the server's process ----------------------------------------------------------------------------

def install_hook(target: str, stage: str, nth: int, arm: str, record: str) -> None:
    """SIGKILL this process at the nth `stage` event of `target` once the file `arm` exists."""
    state = {"count": 0, "busy": False}

    def what_and_why(path: str) -> tuple[str | None, str | None]:
        what = reason = None
        f = sys._getframe(2)
        while f is not None:
            name, file = f.f_code.co_name, f.f_code.co_filename
            snap = f.f_locals.get("snap")
            if reason is None and snap is not None:
                reason = getattr(snap, "reason", None)
            if what is None:
                if name == "_write_chunk":
                    what = "chunk"
                elif name == "write" and file.endswith("checkpoint_files.py"):
                    what = "manifest"
                elif name == "_job_save":
                    what = "session"
                elif file.endswith(os.path.join("responses", "stored.py")):
                    what = "response"
                elif name in ("evict_to_budget", "_evict"):
                    what = "disk-eviction"
            f = f.f_back
        return what, reason

    def land(event_stage: str, path: str, what: str | None, reason: str | None) -> None:
        with open(record, "a") as out:
            out.write(json.dumps({"target": target, "stage": event_stage, "what": what, "reason": reason,
                                  "file": os.path.basename(path)}) + "\n")
        os.kill(os.getpid(), signal.SIGKILL)

    def hook(event: str, args: tuple) -> None:
        if state["busy"]:
            return
        if event == "open" and len(args) == 3 and isinstance(args[0], str) and args[0].endswith(".tmp") \
                and isinstance(args[2], int) and args[2] & os.O_CREAT:
            ev, path = "create", args[0]
        elif event == "os.rename" and isinstance(args[0], str) and args[0].endswith(".tmp"):
            ev, path = "commit", args[0]
        elif event == "os.remove" and isinstance(args[0], str) and not args[0].endswith(".tmp"):
            ev, path = "remove", args[0]
        else:
            return
        state["busy"] = True
        try:
            if not os.path.exists(arm):
                return
            what, reason = what_and_why(path)
            hit = (what == target if target in ("chunk", "manifest", "session", "response", "disk-eviction")
                   else reason == target and what in ("chunk", "manifest"))
            wanted = "remove" if target == "disk-eviction" else ("create" if stage == "mid" else stage)
            if not hit or ev != wanted:
                return
            state["count"] += 1
            if state["count"] < nth:
                return
            if stage == "mid":
                delay = random.uniform(0, 0.002)
                threading.Timer(delay, land, ("mid", path, what, reason)).start()
                state["count"] = -10**9  # once
            else:
                land(ev, path, what, reason)
        finally:
            state["busy"] = False

    sys.addaudithook(hook)


def hooked_main(argv: list[str]) -> int:
    spec = os.environ.get("CRASH_TARGET")
    if spec:
        target, stage, nth = spec.split(":")
        install_hook(target, stage, int(nth), os.environ["CRASH_ARM"], os.environ["CRASH_RECORD"])
    from kvsession.cli.main import main

    return main(argv)


# --- the driver -------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        import httpx

        self.httpx = httpx
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "a")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--hooked", "serve", "--port",
                                      str(self.port), *args], stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.log_path = log

    def ready(self) -> "Server":
        httpx = self.httpx
        log = self.log_path
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited at its start: {log.read_text()[-3000:]}")
        raise RuntimeError("the server did not start in 300 s")

    def post(self, path: str, body: dict | None = None, timeout: float = 300):
        return self.httpx.post(self.url + path, json=body, timeout=timeout)

    def get(self, path: str, timeout: float = 60):
        return self.httpx.get(self.url + path, timeout=timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()


class Conversation:
    """canned: the history carries a fixed assistant turn, not the reply (see the module's docstring)."""

    def __init__(self, rng: random.Random, n: int, canned: bool):
        self.rng, self.n, self.canned = rng, n, canned
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": SYSTEM}]
        self.turns = 0

    def ask(self) -> list[dict]:
        topic = self.rng.choice(TOPICS)
        self.messages.append({"role": "user", "content": f"Conversation {self.n}, turn {self.turns}: tell me "
                                                         f"about {topic}, and what it reminds you of."})
        return self.messages

    def answered(self, reply: str, prompt_tokens: int, ctx: int) -> None:
        self.messages.append({"role": "assistant", "content": f"Noted, turn {self.turns}." if self.canned else reply})
        self.turns += 1
        if prompt_tokens > ctx - 300:
            self.reset()

    def pending(self) -> bool:
        return self.messages[-1]["role"] == "user"


def chat_body(messages: list[dict]) -> dict:
    return {"messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 5}


def distance(a: dict, b: dict) -> float:
    """How far two replies' distributions are apart: the largest difference of a token's log-probability
    among both top-5s, at each step up to and including the first where their tokens differ."""
    def top(step: dict) -> dict:  # by bytes: byte tokens that are not UTF-8 all print as U+FFFD
        seen = Counter(str(t.get("bytes", t["token"])) for t in step["top_logprobs"])
        return {k: t["logprob"] for t in step["top_logprobs"] if seen[k := str(t.get("bytes", t["token"]))] == 1}

    worst = 0.0
    for x, y in zip(a["choices"][0]["logprobs"]["content"], b["choices"][0]["logprobs"]["content"]):
        tx, ty = top(x), top(y)
        worst = max([worst] + [abs(tx[t] - ty[t]) for t in tx.keys() & ty.keys()])
        if x.get("bytes", x["token"]) != y.get("bytes", y["token"]):
            break
    return worst


def reply_of(r) -> tuple[str, int]:
    d = r.json()
    return d["choices"][0]["message"]["content"], d["usage"]["prompt_tokens"]


def verify_copy(copy: Path) -> dict:
    """`kvsession cache verify` on a copy of the folder as the kill left it."""
    from kvsession.cli.main import main

    if not copy.exists():
        return {"rc": 0, "line": "no folder yet"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["cache", "verify", "--dir", str(copy)])
    lines = out.getvalue().strip().splitlines()
    return {"rc": rc, "line": lines[-1] if lines else "", "removed": [ln for ln in lines if ln.startswith("removed ")]}


def store_bytes(kv: Path) -> int:
    """What the store's budget covers: its chunks and manifests."""
    return sum(p.stat().st_size for suffix in ("*.kvc", "*.kvm") for p in kv.rglob(suffix) if p.is_file())


def temporaries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp"))


def main() -> int:
    if sys.argv[1:2] == ["--hooked"]:
        return hooked_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=120)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/kvsession-crash"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, help="a GGUF (default: a tiny random model with a 2048-token context)")
    ap.add_argument("--budget-mb", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of traffic a cycle at most (3)")
    ap.add_argument("--replies", choices=("canned", "generated"), default="canned",
                    help="what a conversation's history carries as the assistant's turns (canned)")
    ap.add_argument("--minutes", type=float, help="stop after this long (the last restart's checks still run)")
    ap.add_argument("--clean", action="store_true", help="the control: every cycle ends with SIGTERM, no kill")
    ap.add_argument("--out", type=Path, help="the summary as JSON")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    if args.dir.exists():
        shutil.rmtree(args.dir)
    args.dir.mkdir(parents=True)
    model = args.model
    ctx = 2048
    if model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny import TinySpec, write_tiny

        model = write_tiny(args.dir / "tiny.gguf", TinySpec(context=ctx))
    os.environ["KVSESSION_CACHE_DIR"] = str(args.dir / "digests")
    disk = args.dir / "disk"
    kv, sessions = disk / "kv", disk / "sessions"
    arm, record, trace = args.dir / "armed", args.dir / "landed.jsonl", args.dir / "trace.jsonl"
    common = ["--model", str(model), "--precision", "f32", "--kv-dtype", "f32", "--ctx", str(ctx)]
    crash_args = common + ["--kv-disk-dir", str(kv), "--sessions-dir", str(sessions), "--kv-disk-space-mb",
                           str(args.budget_mb), "--kv-disk-min-tokens", "16", "--kv-cache-chunk-tokens", "16",
                           "--kv-cache-continued-interval-tokens", "64", "--live-kv-mb", "1",
                           "--responses-space-mb", "1", "--trace", str(trace)]
    reference = Server(common + ["--no-kv-disk", "--live-kv-mb", "1", "--sessions-dir", str(args.dir / "ref")],
                       args.dir / "reference.log").ready()
    convs = [Conversation(rng, i, args.replies == "canned") for i in range(4)]
    saves: dict[str, set[int]] = {}  # name -> token counts a save was given (answered or cut off)
    answered_saves: set[str] = set()
    cut_off: set[str] = set()  # names whose last save the kill cut off: its token count is not known
    responses: dict[str, str] = {}  # id -> output text, answered 200
    tally: Counter = Counter()
    landed: Counter = Counter()
    problems: list[str] = []
    worst_budget = 0.0
    litter: list[int] = []
    verify_lines: Counter = Counter()
    outcomes: Counter = Counter()  # each conversation's turn after a restart: restored or missed, and its reply
    worst_distance = 0.0

    checker = concurrent.futures.ThreadPoolExecutor(1)
    started = time.time()

    def summary() -> dict:
        """What the run found so far (written after every cycle: a run stopped early keeps its figures)."""
        d = {"kills": tally["kills"], "minutes": round((time.time() - started) / 60, 1), "landed": dict(landed),
             "turns after restarts": dict(outcomes),
             "largest distance of a restore's distributions from the reference's": round(worst_distance, 4),
             "checks": dict(tally), "verify": dict(verify_lines), "worst budget fraction": round(worst_budget, 3),
             "temporaries after restarts (max)": max(litter, default=0), "problems": problems}
        if args.out:
            args.out.write_text(json.dumps(d, indent=2))
        return d

    def last_trace() -> dict:
        return json.loads(trace.read_text().splitlines()[-1])

    try:
        for cycle in itertools.count():
            landed_before = record.read_text().count("\n") if record.exists() else 0
            copy = args.dir / f"after-kill-{cycle}"  # the folder as the kill left it (kept for a look)
            if kv.exists():
                shutil.copytree(kv, copy, ignore=shutil.ignore_patterns("responses", "tool_calls.jsonl"))
            last = cycle >= args.kills or (args.minutes and time.time() - started > args.minutes * 60)
            target = None if last else "clean" if args.clean else TARGETS[cycle % len(TARGETS)]
            stage = "remove" if target == "disk-eviction" else rng.choice(STAGES)
            nth = rng.randint(1, 3)
            if arm.exists():
                arm.unlink()
            env = {"CRASH_TARGET": f"{target}:{stage}:{nth}", "CRASH_ARM": str(arm), "CRASH_RECORD": str(record)} \
                if target not in (None, "random", "clean") else {}
            server = Server(crash_args, args.dir / "server.log", env)  # starts while the copy is verified
            if cycle:
                v = verify_copy(copy)
                verify_lines["exit 0" if v["rc"] == 0 else "exit 1"] += 1
                for r in v.get("removed", []):
                    verify_lines[r.split()[1]] += 1
                if v["rc"] != 0:
                    problems.append(f"cycle {cycle}: verify: {v}")
            server.ready()
            # --- the checks after a restart ---
            for i, c in enumerate(convs):
                messages = list(c.messages if c.pending() else c.ask())
                ref = checker.submit(reference.post, "/v1/chat/completions", chat_body(messages))
                r = server.post("/v1/chat/completions", chat_body(messages))
                if r.status_code != 200:
                    problems.append(f"cycle {cycle}: conversation {i}'s turn after the restart: {r.status_code} "
                                    f"{r.text[:300]}")
                    continue
                if i == 0:
                    tally["first request answered"] += 1
                got, n = reply_of(r)
                source = last_trace()["source"] if cycle else "first run"
                ref = ref.result()
                want, _ = reply_of(ref)
                if cycle:
                    far = distance(r.json(), ref.json())
                    kind = "restored" if source == "disk" else "missed"
                    if got == want:
                        outcomes[f"{kind}: the reference's reply"] += 1
                    elif far < TIE:
                        outcomes[f"{kind}: another reply, a near tie flipped (distributions within {TIE})"] += 1
                    else:
                        outcomes[f"{kind}: ANOTHER REPLY, distributions {far:.3f} apart"] += 1
                        problems.append(f"cycle {cycle}: conversation {i} ({source}): {got!r} != {want!r}, "
                                        f"distributions {far:.3f} apart")
                    if source == "disk":
                        worst_distance = max(worst_distance, far)
                    if got != want:  # kept for a look: the request, both replies, the trace line
                        (args.dir / f"disagree-{cycle}-{i}.json").write_text(json.dumps(
                            {"messages": messages, "got": r.json(), "want": ref.json(), "trace": last_trace()}))
                c.answered(want, n, ctx)
            for name, counts in saves.items():
                r = server.post(f"/v1/sessions/{name}/restore")
                if r.status_code == 200:
                    tally["named session whole"] += 1
                    if r.json()["tokens"] not in counts and name not in cut_off:
                        problems.append(f"cycle {cycle}: session {name} restored {r.json()['tokens']} tokens, "
                                        f"saved {sorted(counts)}")
                    counts.add(r.json()["tokens"])
                    cut_off.discard(name)
                elif r.status_code == 404 and name not in answered_saves:
                    tally["named session absent"] += 1
                else:
                    problems.append(f"cycle {cycle}: session {name}: {r.status_code} {r.text[:300]}")
            for rid, text in list(responses.items())[-12:]:
                r = server.get(f"/v1/responses/{rid}")
                if r.status_code != 200 or r.json()["output"][0]["content"][0]["text"] != text:
                    problems.append(f"cycle {cycle}: stored response {rid}: {r.status_code} {r.text[:200]}")
                else:
                    tally["stored response read back"] += 1
            if cycle:
                left = temporaries(disk)
                litter.append(len(left))
                if left:
                    problems.append(f"cycle {cycle}: temporaries left after the restart: {left[:5]}")
                used = store_bytes(kv)
                worst_budget = max(worst_budget, used / (args.budget_mb << 20))
                if used > args.budget_mb << 20:
                    problems.append(f"cycle {cycle}: the cache folder holds {used} bytes, over its budget")
            if target is None:
                server.kill()
                break
            # --- traffic until the kill lands ---
            arm.touch()
            killer = None
            if target == "random":
                killer = threading.Timer(rng.uniform(0.05, 3.0), lambda s=server: s.alive() and s.kill())
                killer.start()

            def turn(c: Conversation) -> None:
                messages = list(c.ask())
                try:
                    r = server.post("/v1/chat/completions", chat_body(messages))
                except server.httpx.HTTPError:
                    return
                if r.status_code == 200:
                    c.answered(*reply_of(r), ctx)
                else:
                    problems.append(f"cycle {cycle}: a turn under traffic: {r.status_code} {r.text[:300]}")

            def save(name: str) -> None:
                counts = saves.setdefault(name, set())
                try:
                    r = server.post(f"/v1/sessions/{name}/save")
                except server.httpx.HTTPError:
                    cut_off.add(name)  # the kill came first: the file is the last whole save, or this one
                    return
                if r.status_code == 200:
                    counts.add(r.json()["tokens"])
                    answered_saves.add(name)
                elif not (r.status_code == 409 and "no live session" in r.text):
                    problems.append(f"cycle {cycle}: save {name}: {r.status_code} {r.text[:300]}")

            def respond() -> None:
                body = {"input": f"Say something about {rng.choice(TOPICS)}.", "max_output_tokens": 8,
                        "temperature": 0, "store": True}
                try:
                    r = server.post("/v1/responses", body)
                except server.httpx.HTTPError:
                    return
                if r.status_code == 200:
                    d = r.json()
                    responses[d["id"]] = d["output"][0]["content"][0]["text"]
                else:
                    problems.append(f"cycle {cycle}: a response under traffic: {r.status_code} {r.text[:300]}")

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                for rnd in range(args.rounds):
                    if not server.alive():
                        break
                    jobs = [pool.submit(turn, c) for c in convs]
                    jobs.append(pool.submit(save, f"s{rnd % 2}"))
                    jobs.append(pool.submit(respond))
                    for j in jobs:
                        j.result()
            if target in ("shutdown", "clean") and server.alive():
                server.proc.send_signal(signal.SIGTERM)
                try:
                    server.proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    problems.append(f"cycle {cycle}: no exit 120 s after SIGTERM")
            if killer is not None:
                killer.cancel()
            landed_now = record.read_text().count("\n") if record.exists() else 0
            if landed_now > landed_before:
                d = json.loads(record.read_text().splitlines()[-1])
                landed[f"{d['target']}: {d['stage']} of a {d['what']}" + (f" ({d['reason']})" if d["reason"] else "")
                       ] += 1
            elif target == "random":
                landed["random moment"] += 1
            elif target == "clean":
                landed["no kill: SIGTERM, a clean stop"] += 1
            elif target == "shutdown" and not server.alive():
                landed["shutdown: exited before a checkpoint file was written (nothing to write)"] += 1
            else:
                landed[f"{target}: not reached in {args.rounds} rounds, killed after them"] += 1
            server.kill()
            tally["kills"] += 1
            print(f"cycle {cycle}: {target}:{stage}:{nth} -> {sum(landed.values())} kills, "
                  f"{len(problems)} problems", flush=True)
            summary()
    finally:
        reference.kill()
    print(json.dumps(summary(), indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
