"""`kvsession bench --concurrency`: requests decoded together, prefill that yields, speculative decoding.

Against llama.cpp's own server (`--llama-server PATH`, built by
tools/llama_server.sh) run the same way in the same run; without it, ours
only. Both servers get the same raw prompts through /v1/completions, greedy:

- aggregate decode tokens/s of 1, 2, 4 and 8 concurrent streams (distinct
  prompts, 64 tokens each, ignore_eos), each server with as many slots as
  streams (ours `--parallel N --spec off`, llama-server `-np N`);
- the time to first token of a short request sent while a ~3,000-token
  prompt is being prefilled;
- speculative decoding at one stream: a reply that repeats its prompt (a
  60-line function rewritten with one change) and one that does not
  (prose), ours `--spec ngram` against `--spec off` (whose greedy outputs
  must be equal) and llama-server `--spec-type ngram-simple` against none.

Medians of --repeat runs; ratios are ours / llama.cpp's.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from .server import Server, ServerProcess

STREAMS = (1, 2, 4, 8)
TOKENS = 64
TOPICS = ["the sea", "a lighthouse keeper", "bees in winter", "a city at night", "an old map", "rain on a roof",
          "the first train", "a garden of stones"]
FUNCTION = '''def load_settings(path, defaults=None, strict=False):
    """Read a settings file of KEY = VALUE lines into a dict, with types."""
    settings = dict(defaults or {})
    errors = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                errors.append(f"line {number}: no '=' in {line!r}")
                continue
            key, _, value = line.partition("=")
            key = key.strip().lower().replace("-", "_")
            value = value.strip()
            if not key.isidentifier():
                errors.append(f"line {number}: {key!r} is not a name")
                continue
            if value.startswith('"') and value.endswith('"'):
                settings[key] = value[1:-1]
            elif value.lower() in ("true", "yes", "on"):
                settings[key] = True
            elif value.lower() in ("false", "no", "off"):
                settings[key] = False
            elif value.isdigit():
                settings[key] = int(value)
            else:
                try:
                    settings[key] = float(value)
                except ValueError:
                    settings[key] = value
    if "port" in settings and not 0 < settings["port"] < 65536:
        errors.append(f"port {settings['port']} is out of range")
    if "timeout" in settings and settings["timeout"] <= 0:
        errors.append("timeout must be positive")
    if "workers" in settings:
        workers = settings["workers"]
        if not isinstance(workers, int) or workers < 1:
            errors.append(f"workers must be a whole number, got {workers!r}")
    if "log_level" in settings:
        level = str(settings["log_level"]).upper()
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            errors.append(f"unknown log level {level}")
        settings["log_level"] = level
    if "hosts" in settings:
        hosts = [h.strip() for h in str(settings["hosts"]).split(",")]
        settings["hosts"] = [h for h in hosts if h]
    if "data_dir" in settings:
        settings["data_dir"] = os.path.expanduser(settings["data_dir"])
        if strict and not os.path.isdir(settings["data_dir"]):
            errors.append(f"no folder {settings['data_dir']}")
    if errors and strict:
        raise ValueError("; ".join(errors))
    for message in errors:
        print("warning:", message, file=sys.stderr)
    settings["source"] = os.path.abspath(path)
    settings["loaded"] = True
    return settings
'''
REPEATING = ("Rewrite this Python function so that it takes `encoding` as a parameter (default \"utf-8\") "
             "and uses it to open the file. Answer with the whole function, code only."
             f"\n```python\n{FUNCTION}```\n")
PROSE = "Write a long essay about the history of sailing ships, in plain prose without lists.\n"


class Peer(ServerProcess):
    """A llama-server subprocess on a free port."""

    def __init__(self, binary: str, model: Path, folder: Path, *extra: str, webui_flag: bool = True):
        """webui_flag: the binary takes --no-webui (llama.cpp's does; ik_llama.cpp's has no such flag)."""
        no_webui = ("--no-webui",) if webui_flag else ()
        super().__init__(lambda port: [binary, "-m", str(model), "--port", str(port), *no_webui, *extra],
                         folder / "llama-server.log", "llama-server")


def complete(url: str, prompt: str, max_tokens: int, *, ignore_eos: bool = True, timeout: float = 1200) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=timeout, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos})
    r.raise_for_status()
    return r.json()


def aggregate(url: str, n: int, tokens: int = TOKENS) -> float:
    """Decode tokens/s of n concurrent streams: every stream's tokens over the wall time of all of them."""
    counts = [0] * n

    def one(i: int) -> None:
        counts[i] = complete(url, f"Write a story about {TOPICS[i % len(TOPICS)]}.\n", tokens)["usage"][
            "completion_tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def ttft_during_prefill(url: str, nonce: int) -> float:
    """Seconds to the first token of a short streamed request sent 1 s into a ~3,000-token prompt's prefill."""
    long_prompt = f"{nonce} " + " ".join(f"The {TOPICS[i % 8]} is number {i}." for i in range(420))
    t = threading.Thread(target=complete, args=(url, long_prompt, 1))
    t.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/completions", timeout=1200, json={
            "model": "m", "prompt": f"{nonce} Say hello.", "max_tokens": 8, "temperature": 0, "stream": True,
            "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and first is None and json.loads(line[6:])["choices"]:
                first = time.perf_counter() - t0
    t.join()
    return first if first is not None else float("nan")


def decode_speed(url: str, prompt: str, tokens: int = 256) -> tuple[float, str]:
    """tokens/s of one greedy reply (its time from send to done), and its text."""
    t0 = time.perf_counter()
    r = complete(url, prompt, tokens, ignore_eos=False)
    return r["usage"]["completion_tokens"] / (time.perf_counter() - t0), r["choices"][0]["text"]


def median(fn, repeat: int) -> float:
    return statistics.median(fn(i) for i in range(repeat))


def measured(server: ServerProcess, fn):
    """fn(url) on the server after one warm-up request; the server is stopped afterwards."""
    try:
        complete(server.url, "warm up", 4)
        return fn(server.url)
    finally:
        server.stop()


def run(args) -> int:
    from ..engine import model_path

    model = model_path(args.model)
    peer = args.llama_server
    threads = str(args.threads or 2)
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        print(f"model {model.name}; {args.repeat} runs each, medians; ours / llama-server where measured")
        print("\nstreams  ours tok/s  scale  llama-server tok/s  scale  ratio")
        base = {}
        for n in STREAMS:
            def streams(url: str) -> float:
                return median(lambda i: aggregate(url, n), args.repeat)

            o = measured(Server(str(model), folder / f"ours{n}", "--parallel", str(n), "--spec", "off", "-t",
                                threads), streams)
            p = measured(Peer(peer, model, folder, "-np", str(n), "-c", str(2048 * n), "-t", threads),
                         streams) if peer else None
            base.setdefault("ours", o)
            if p is not None:
                base.setdefault("peer", p)
            print(f"{n:>7}  {o:>10.1f}  {o / base['ours']:>4.2f}x  " +
                  (f"{p:>18.1f}  {p / base['peer']:>4.2f}x  {o / p:>4.2f}x" if p else f"{'-':>18}"))

        t_ours = measured(Server(str(model), folder / "ttft", "--parallel", "2", "-t", threads),
                          lambda url: median(lambda i: ttft_during_prefill(url, i), args.repeat))
        t_peer = measured(Peer(peer, model, folder, "-np", "2", "-c", "16384", "-t", threads),
                          lambda url: median(lambda i: ttft_during_prefill(url, 100 + i), args.repeat)) \
            if peer else None
        print(f"\nfirst token of a short request sent during a ~3,000-token prefill: ours {t_ours:.2f} s" +
              (f", llama-server {t_peer:.2f} s" if t_peer is not None else ""))

        print("\nspeculative decoding, one stream, greedy   tok/s off  tok/s on  speed-up  outputs equal")
        for name, prompt in (("repeating (a function rewritten)", REPEATING), ("prose", PROSE)):
            speeds, texts = {}, {}
            for spec in ("off", "ngram"):
                runs = measured(Server(str(model), folder / f"spec-{spec}", "--parallel", "1", "--spec", spec,
                                       "-t", threads),
                                lambda url: [decode_speed(url, prompt) for _ in range(args.repeat)])
                speeds[spec] = statistics.median(s for s, _ in runs)
                texts[spec] = runs[0][1]  # the first, cold run of each (a later one reuses the live session)
            line = (f"  ours, {name:<36} {speeds['off']:>8.1f}  {speeds['ngram']:>8.1f}  "
                    f"{speeds['ngram'] / speeds['off']:>7.2f}x  {texts['off'] == texts['ngram']}")
            print(line)
            if peer:
                pspeeds = {}
                for spec in ((), ("--spec-type", "ngram-simple")):
                    pspeeds[bool(spec)] = measured(
                        Peer(peer, model, folder, "-np", "1", "-c", "8192", "-t", threads, *spec),
                        lambda url: statistics.median(decode_speed(url, prompt)[0] for _ in range(args.repeat)))
                print(f"  llama-server, {name:<28} {pspeeds[False]:>8.1f}  {pspeeds[True]:>8.1f}  "
                      f"{pspeeds[True] / pspeeds[False]:>7.2f}x   (ours / theirs with spec: "
                      f"{speeds['ngram'] / pspeeds[True]:.2f}x)")
    return 0
