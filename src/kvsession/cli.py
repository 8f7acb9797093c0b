"""The `kvsession` command: argument parsing and printing, nothing else.

Each subcommand parses its flags, calls into the library, and prints. Every
KvsessionError becomes one line on stderr and exit status 1; bad flags are
argparse's exit status 2.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Sequence

from .errors import KvsessionError
from .sampling import SamplerParams


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {v}")
    return v


def _finite_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(v):  # float() takes "nan" and "inf", which no sampling parameter can use
        raise argparse.ArgumentTypeError(f"expected a finite number, got {s}")
    return v


def _nonneg_float(s: str) -> float:
    v = _finite_float(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {s}")
    return v


def _positive_float(s: str) -> float:
    v = _finite_float(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {s}")
    return v


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", metavar="PATH",
                   help="GGUF model file, or smollm2-135m / gemma3-270m / qwen2.5-coder-0.5b / qwen2.5-coder-1.5b "
                        "(from PyPI) "
                        "(default: $KVSESSION_MODEL, else smollm2-135m)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--precision", choices=("bf16", "f32"), default="bf16",
                   help="matrix products in bfloat16 with packed 4-bit weights (fast, default) or float32 (reference)")


def _add_sampling_flags(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    d = SamplerParams()
    p.add_argument("--max-tokens", "-n", type=_positive_int, default=max_tokens,
                   help=f"tokens to generate at most ({max_tokens})")
    p.add_argument("--temp", type=_nonneg_float, default=d.temperature, help=f"temperature, 0 for greedy ({d.temperature})")
    p.add_argument("--top-k", type=int, default=d.top_k, help=f"top-k, 0 for off ({d.top_k})")
    p.add_argument("--top-p", type=_finite_float, default=d.top_p, help=f"top-p ({d.top_p})")
    p.add_argument("--min-p", type=_finite_float, default=d.min_p, help=f"min-p ({d.min_p})")
    p.add_argument("--seed", type=int, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")


def _sampler(args) -> SamplerParams:
    try:
        return SamplerParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                             min_p=args.min_p, seed=args.seed)
    except ValueError as e:
        raise KvsessionError(str(e)) from None


def _engine(args):
    from .engine import Engine

    return Engine.load(args.model, device=args.device, precision=args.precision)


def cmd_run(args) -> int:
    import time

    from .generate import Stats, stream
    from .sampling import Sampler
    from .named import make_folder, session_path
    from .session import Session

    engine = _engine(args)
    params = _sampler(args)
    path = session_path(args.session, args.sessions_dir) if args.session else None
    if path is not None and path.exists():
        t0 = time.perf_counter()
        session = Session.load(path, engine)
        ms = (time.perf_counter() - t0) * 1e3
        # new flags apply from here on; the generator goes on where it stopped unless --seed reseeds it
        session.sampler = Sampler(params) if args.seed is not None else _with_params(session.sampler, params)
        before = len(session)
    else:
        session = engine.session(sampler=params, kv_dtype=args.kv_dtype)
        before = 0
    messages = list(session.meta.get("messages", []))
    if args.raw:
        prompt = engine.tokenizer.encode(args.prompt, add_bos=None if not len(session) else False)
    else:
        if args.system and not messages:
            messages.append({"role": "system", "content": args.system})
        messages.append({"role": "user", "content": args.prompt})
        prompt = session.reuse_prefix(engine.chat_prompt(messages))
    if path is not None and before:
        recomputed = before - len(session)
        print(f"restored {before} tokens in {ms:.1f} ms, {recomputed} recomputed", file=sys.stderr)
    stats = Stats()
    reply = []
    for delta in stream(session, prompt, max_tokens=args.max_tokens, stop=args.stop,
                        chunk_size=args.chunk_size, stats=stats):
        reply.append(delta.text)
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(
        f"[{stats.prompt_tokens} prompt tokens at {stats.prefill_tps:.0f} tok/s, "
        f"{stats.generated_tokens} generated at {stats.decode_tps:.1f} tok/s, finish: {stats.finish_reason}]",
        file=sys.stderr,
    )
    if path is not None:
        if not args.raw:
            messages.append({"role": "assistant", "content": "".join(reply)})
            session.meta["messages"] = messages
        make_folder(path.parent)
        info = session.save(path)
        print(f"saved {len(session)} tokens ({info.bytes / 1e6:.1f} MB) in {info.seconds * 1e3:.1f} ms to {path}",
              file=sys.stderr)
    return 0


def _with_params(sampler, params):
    from .sampling import Sampler

    s = Sampler(params)
    s.rng = sampler.rng
    return s


def cmd_inspect(args) -> int:
    """Header, layers, sizes and text of a session file, every checksum verified; no model needed.

    The header is checked whole before anything is printed, and the sections are streamed a block at
    a time: memory stays small whatever sizes a (hostile) header declares.
    """
    import datetime
    import json
    from pathlib import Path

    from . import fileformat
    from .errors import SessionFileError, UnreadableSession
    from .session import check_session_header

    path = Path(args.file)
    with fileformat.open_regular(path) as f:
        try:
            head = f.read(len(fileformat.MAGIC))
            if head and not fileformat.MAGIC.startswith(head) and os.path.lexists(f"{path}.json"):
                return _inspect_raw(path, args.preview)
            f.seek(0)
            header = fileformat.read_header(f, str(path))
            check_session_header(header, str(path))
            text, bad = _Ends(4 * args.preview + 4), []
            for sec in header.sections:
                try:
                    fileformat.verify_section(f, header, sec.name, where=str(path),
                                              sink=text if sec.name == "text" else None)
                except SessionFileError as e:
                    bad.append((sec.name, str(e)))
            size = os.fstat(f.fileno()).st_size
        except OSError as e:
            raise UnreadableSession(f"{path}: {e.strerror}") from None
    h = header.fields
    fp = h["model"]["fingerprint"]
    print(f"file        {path} ({size:,} bytes, format {fileformat.VERSION[0]})")
    print(f"model       {h['model']['file']}  arch {fp['kv_shape']['arch']}  weights {fp['weights'][:16]}")
    print(f"created     {datetime.datetime.fromtimestamp(h['created']).isoformat(timespec='seconds')}")
    print(f"tokens      {h['n_tokens']}   kv dtype {h['kv_dtype']}   row shape {h['row_shape']}   "
          f"logits {'yes' if h['has_logits'] else 'no'}   partial {'yes' if h['partial'] else 'no'}")
    print(f"sampler     {json.dumps(h['sampler']['params'])}")
    if h["meta"]:
        print(f"meta        {', '.join(sorted(h['meta']))}")
    sizes = {sec.name: sec.length for sec in header.sections}
    for first, last, d in _runs(h["layers"]):
        nbytes = sizes.get("layer.%d" % d["index"], 0)
        which = f"layer {first}" if first == last else f"layers {first}-{last}"
        print(f"{which:<12}{d['kind']}" + (f" (window {d['window']})" if d["window"] else "")
              + f", rows [{d['start']}, {d['start'] + d['rows']}), {nbytes:,} bytes" + (" each" if last > first else ""))
    print("sections    " + ", ".join(f"{sec.name} {sec.length:,} B" for sec in header.sections
                                      if not sec.name.startswith("layer.")))
    if text.total and "text" not in dict(bad):
        print(f"text        {text.preview(args.preview)!r}")
    if bad:
        for name, err in bad:
            print(f"BAD         {err}")
        raise SessionFileError(f"{path}: {len(bad)} of {len(header.sections)} sections failed their checksum")
    print(f"checksums   all {len(header.sections) + 1} ok (header and every section)")
    return 0


class _Ends:
    """The first and the last n bytes of a stream (all of it when it is short): a preview of a section
    that costs 2n bytes of memory whatever the section's length."""

    def __init__(self, n: int):
        self.n, self.head, self.tail, self.total = n, bytearray(), bytearray(), 0

    def __call__(self, block: memoryview) -> None:
        self.head += block[: self.n - len(self.head)]
        self.tail = (self.tail + block)[-self.n:]
        self.total += len(block)

    def preview(self, chars: int) -> str:
        """The text, or its first and last chars/2 characters when it has more than `chars`."""
        head = bytes(self.head).decode("utf-8", errors="replace")
        if self.total <= self.n and len(head) <= chars:
            return head
        tail = bytes(self.tail if self.total > self.n else self.head).decode("utf-8", errors="replace")
        return head[: chars // 2] + " [...] " + tail[-(chars // 2):]


def _runs(layers: list[dict]):
    """(first index, last index, description) for runs of consecutive layers that differ only in index."""
    out = []
    for d in layers:
        key = {k: v for k, v in d.items() if k != "index"}
        if out and out[-1][1] == d["index"] - 1 and {k: v for k, v in out[-1][2].items() if k != "index"} == key:
            out[-1] = (out[-1][0], d["index"], out[-1][2])
        else:
            out.append((d["index"], d["index"], d))
    return out


def _inspect_raw(path, preview: int) -> int:
    from . import fileformat
    from .errors import SessionFileError
    from .session import open_raw_blob, read_raw_manifest

    m = read_raw_manifest(path)
    print(f"file        {path} ({m['blob_bytes']:,} bytes, raw format; manifest {path.name}.json)")
    print(f"model       {m['model']['file']}")
    print(f"tokens      {m['n_tokens']}   kv dtype {m['kv_dtype']}   layers {m['n_layers']}   "
          f"kv heads {m['n_kv_heads']}   head dim {m['head_dim']}")
    bad = []
    with open_raw_blob(path, m) as f:
        for d in m["layers"]:  # K then V, back to back (read_raw_manifest checked the ranges)
            digest = fileformat.checksum_range(f, d["k"][0], d["k"][1] + d["v"][1], f"{path}: layer {d['index']}")
            if "xxh3" in d and digest != int(d["xxh3"], 16):
                bad.append(d["index"])
    plain = [{"index": d["index"], "kind": d["kind"], "window": d["window"], "start": d["start"], "rows": d["rows"],
              "bytes": d["k"][1] + d["v"][1]} for d in m["layers"]]
    for first, last, d in _runs(plain):
        which = f"layer {first}" if first == last else f"layers {first}-{last}"
        print(f"{which:<12}{d['kind']}" + (f" (window {d['window']})" if d["window"] else "")
              + f", rows [{d['start']}, {d['start'] + d['rows']}), {d['bytes']:,} bytes" + (" each" if last > first else ""))
    text = m["text"]
    if text:
        print(f"text        {(text if len(text) <= preview else text[: preview // 2] + ' [...] ' + text[-preview // 2:])!r}")
    if bad:
        raise SessionFileError(f"{path}: layers {bad} failed their checksum")
    print(f"checksums   all {len(m['layers'])} layers ok")
    return 0


def cmd_info(args) -> int:
    from .engine import default_model_path, model_path
    from .gguf_loader import GGUFFile

    name = args.model_path or args.model
    f = GGUFFile(model_path(name) if name else default_model_path())
    c = f.config
    from collections import Counter

    types = Counter(t.tensor_type.name for t in f.tensors.values())
    params = sum(int(t.n_elements) for t in f.tensors.values())
    print(f"file          {f.path}")
    print(f"name          {f.meta('general.name', '?')}")
    print(f"architecture  {c.arch}")
    print(f"parameters    {params:,} ({', '.join(f'{k} x{v}' for k, v in types.most_common())})")
    print(f"layers        {c.n_layers} (d_model {c.d_model}, d_ff {c.d_ff})")
    print(f"attention     {c.n_heads} heads, {c.n_kv_heads} kv heads, head_dim {c.head_dim}")
    kinds = Counter(f"{s.kind}" + (f" window {s.window}" if s.window else "") for s in c.layers)
    print(f"layer kinds   {', '.join(f'{k} x{v}' for k, v in kinds.items())}")
    for kind, r in {s.kind: s.rope for s in c.layers}.items():
        print(f"{'rope (' + kind + ')':<14}{r.kind}, base {r.base:g}, dim {r.dim}, linear scale {r.linear_scale:g}")
    print(f"context       {c.context_length}")
    print(f"vocab         {c.vocab_size} ({f.meta('tokenizer.ggml.model')}/{f.meta('tokenizer.ggml.pre', '-')})")
    print(f"kv per token  {2 * c.n_layers * c.kv_row_values} values ({2 * c.n_layers * c.kv_row_values * 4:,} B in f32)")
    print(f"fingerprint   {f.fingerprint.digest}")
    print(f"weights       xxh3-128 {f.fingerprint.weights}")
    return 0


def cmd_chat(args) -> int:
    from .chat import run

    _sampler(args)  # flags checked before the model loads
    return run(_engine(args), args)


def cmd_serve(args) -> int:
    import logging

    from .server import ServerOptions, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    options = ServerOptions(host=args.host, port=args.port, ctx=args.ctx, kv_disk_dir=args.kv_disk_dir,
                            kv_disk_space_mb=args.kv_disk_space_mb, kv_disk_min_tokens=args.kv_disk_min_tokens,
                            kv_disk_retry_seconds=args.kv_disk_retry, api_key=args.api_key,
                            sessions_dir=args.sessions_dir, kv_dtype=args.kv_dtype, keepalive_seconds=args.keepalive,
                            max_tokens=args.max_tokens, trace=args.trace, cors=tuple(args.cors))
    return serve(_engine(args), options)


def cmd_cache(args) -> int:
    """kvsession cache ls|show|gc|clear: look after a disk KV cache folder."""
    import time

    from .store import Store, StoreError, default_store_dir

    folder = args.dir or default_store_dir()
    if not os.path.lexists(folder):  # looking after a cache must not create one
        raise KvsessionError(f"{folder}: no such cache folder")
    store = Store(folder)  # a folder it cannot use: StoreUnavailable, one line
    if args.action == "ls":
        entries = store.ls()
        now = time.time()
        print(f"{'key':<12} {'reason':<9} {'tokens':>7} {'bytes':>11} {'hits':>5} {'age':>6}  text")
        for e in entries:
            preview = e.text[-48:].replace("\n", "\\n")
            print(f"{e.key[:12]:<12} {e.reason:<9} {e.n_tokens:>7} {store.exclusive_bytes(e):>11,} "
                  f"{store.decayed_hits(e, now):>5.1f} {_age(now - e.created):>6}  ...{preview}")
        print(f"{len(entries)} checkpoints, {store.total_bytes():,} bytes in {folder}")
    elif args.action == "show":
        if not args.key:
            raise KvsessionError("cache show needs a KEY (a unique prefix of one, from `cache ls`)")
        e = store.get(args.key)
        print(f"key          {e.key}")
        print(f"model        {e.model_file}")
        print(f"reason       {e.reason}")
        print(f"tokens       {e.n_tokens} ({len(e.chunks)} chunks of {store.options.chunk_tokens}, "
              f"tail {e.n_tokens - len(e.chunks) * store.options.chunk_tokens})")
        print(f"bytes        {e.nbytes + sum(e.chunk_bytes):,} ({store.exclusive_bytes(e):,} its own)")
        print(f"logits       {'yes' if e.has_logits else 'no (the next request prefills at least one token)'}")
        print(f"hits         {store.decayed_hits(e):.2f} (half-life {store.options.half_life_hours:g} h)")
        print(f"created      {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e.created))}")
        print(f"last used    {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e.last_used))}")
        damage = store.find_damage(e)
        print(f"verified     {'all checksums ok' if damage is None else 'DAMAGED'}")
        print(f"text         {e.text[:300]!r}{' ...' if len(e.text) > 300 else ''}")
        if damage is not None:
            raise StoreError(f"checkpoint {e.key[:12]} is damaged: {damage}")
    elif args.action == "gc":
        r = store.gc()
        print(f"removed {r['removed']} checkpoints, freed {r['freed_bytes']:,} bytes; "
              f"{len(store.entries)} left, {store.total_bytes():,} bytes")
    elif args.action == "clear":
        if not args.yes:
            raise KvsessionError(f"this would delete {len(store.ls())} checkpoints from {folder}; "
                                 "add --yes to do it")
        print(f"removed {store.clear()} checkpoints from {folder}")
    return 0


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def cmd_bench(args) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsession", description="Local LLM inference with KV caches on disk.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="generate a reply to one prompt")
    p.add_argument("--prompt", "-p", required=True, help="the prompt (a user message unless --raw)")
    p.add_argument("--raw", action="store_true", help="plain completion of the prompt, without the chat template")
    p.add_argument("--system", help="a system message (chat mode)")
    p.add_argument("--chunk-size", type=_positive_int, default=512, help="prefill chunk, in tokens (512)")
    p.add_argument("--kv-dtype", choices=("f32", "f16", "bf16"), default="f16", help="KV cache dtype (f16)")
    p.add_argument("--session", "-s", metavar="NAME_OR_PATH",
                   help="resume this session when it exists, and save it afterwards")
    p.add_argument("--sessions-dir", metavar="DIR", help="where named sessions live "
                   "(default: $KVSESSION_SESSIONS_DIR, else ~/.local/share/kvsession/sessions)")
    _add_model_flags(p)
    _add_sampling_flags(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("inspect", help="print a session file's header, layers and text; verify its checksums")
    p.add_argument("file", help="a .kvs session file, or a raw blob with its .json manifest")
    p.add_argument("--preview", type=_positive_int, default=160, help="characters of text to show (160)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("info", help="print a model's architecture, sizes and fingerprint")
    p.add_argument("model_path", nargs="?", metavar="MODEL")
    p.add_argument("--model", "-m", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("chat", help="a terminal chat whose sessions live on disk (/help inside)")
    p.add_argument("--session", "-s", metavar="NAME", help="start in this saved session (or a new one by that name)")
    p.add_argument("--sessions-dir", metavar="DIR", help="where sessions live "
                   "(default: $KVSESSION_SESSIONS_DIR, else ~/.local/share/kvsession/sessions)")
    p.add_argument("--system", help="the system message of a new conversation")
    p.add_argument("--kv-dtype", choices=("f32", "f16", "bf16"), default="f16", help="KV cache dtype (f16)")
    _add_model_flags(p)
    _add_sampling_flags(p, max_tokens=1024)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="an OpenAI- and Anthropic-compatible HTTP server with a disk KV cache")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (8000)")
    p.add_argument("--ctx", type=_positive_int, help="context per session, in tokens (default: the model's)")
    p.add_argument("--kv-disk-dir", metavar="DIR", help="the disk KV cache folder (default: none)")
    p.add_argument("--kv-disk-space-mb", type=_positive_int, default=4096, help="its budget in MB (4096)")
    p.add_argument("--kv-disk-min-tokens", type=_positive_int, default=512,
                   help="sessions shorter than this are not checkpointed (512)")
    p.add_argument("--api-key", help="require this key (Authorization: Bearer KEY, or x-api-key: KEY)")
    p.add_argument("--sessions-dir", metavar="DIR", help="folder of the named sessions of /v1/sessions")
    p.add_argument("--kv-dtype", choices=("f32", "f16", "bf16"), default="f16", help="KV cache dtype (f16)")
    p.add_argument("--kv-disk-retry", type=_positive_float, default=10.0, metavar="S",
                   help="while the cache folder fails, try it again every S seconds (10)")
    p.add_argument("--keepalive", type=_positive_float, default=5.0, help="seconds between SSE keepalive comments (5)")
    p.add_argument("--max-tokens", type=_positive_int, default=4096,
                   help="reply limit of a request that names none (4096; the context bounds it too)")
    p.add_argument("--trace", metavar="FILE",
                   help="append one JSON line per request: prefix source (live, disk, cold), reuse, speeds")
    p.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                   help="let web pages of this origin call the server (repeatable; others are refused)")
    _add_model_flags(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("cache", help="list, show, clean or clear a disk KV cache folder")
    p.add_argument("action", choices=("ls", "show", "gc", "clear"))
    p.add_argument("key", nargs="?", help="for show: a checkpoint's key (a unique prefix)")
    p.add_argument("--dir", help="the cache folder (default: $KVSESSION_KV_DIR, else ~/.cache/kvsession/kv)")
    p.add_argument("--yes", action="store_true", help="for clear: really delete everything")
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("bench", help="prefill and decode speed (and llama.cpp's, when installed)")
    _add_model_flags(p)
    p.add_argument("--contexts", default="512,2048", help="comma-separated context sizes (512,2048)")
    p.add_argument("--decode-tokens", type=_positive_int, default=64, help="tokens decoded per context (64)")
    p.add_argument("--repeat", type=_positive_int, default=3, help="runs per context; the median is reported (3)")
    p.add_argument("--threads", type=_positive_int, help="torch (and llama.cpp) threads")
    p.add_argument("--peer-python", metavar="PYTHON",
                   help="a Python with llama-cpp-python, to measure llama.cpp in the same run "
                        "(default: $KVSESSION_PEER_PYTHON, else this Python if it has llama_cpp)")
    p.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    p.add_argument("--kv-dtype", choices=("f32", "f16", "bf16"), default="f16", help="KV cache dtype (f16)")
    p.add_argument("--csv", metavar="FILE", help="also write the figures as CSV")
    p.add_argument("--store", action="store_true",
                   help="the disk KV cache's figures instead: prefix sharing, incremental puts, lookups")
    p.add_argument("--server", action="store_true",
                   help="the server's figures instead: time to first token of turn 2, cold / live / from disk, and "
                        "an agent loop of tool turns")
    p.add_argument("--keep-logs", metavar="DIR", help="with --server: keep the servers' logs and cache in DIR")
    p.add_argument("--grammar", action="store_true",
                   help="constrained decoding's figures instead: grammar compile time, per-token mask vs decode step")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KvsessionError as e:
        print(f"kvsession: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nkvsession: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kvsession inspect f | head`: the reader left, nothing more to say
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
