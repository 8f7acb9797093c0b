"""`kvsession run`: one prompt, one streamed reply; with --session, a conversation kept in a file.

The prompt comes from -p or from a file (-f, `-` for standard input). A
session file, when there is one, holds the whole conversation: it is loaded,
the new turn appended and prefilled, the reply generated, the file saved.
Otherwise the prompt starts from the disk KV cache (diskprefix.py): its
longest stored prefix is restored, and the system prompt is checkpointed
the first time. The reply goes to stdout; everything else (timings, what
was restored, the --dump-tokens and --dump-logprobs tables) to stderr, so
the reply can be piped on its own.
"""
from __future__ import annotations

import sys
import time

from ..errors import ContextFull
from ..files.named import make_folder, session_path
from ..generate import Stats, TokenLogprob, TokenRules, stream
from ..sampling import Sampler, SamplerParams
from ..session import Session
from ..store import default_store_dir
from .diskprefix import DiskPrefix, open_store, system_tokens
from .textfile import read_text


def run(engine, args, params: SamplerParams) -> int:
    text = read_text(args.prompt_file) if args.prompt_file is not None else args.prompt
    path = session_path(args.session, args.sessions_dir) if args.session else None
    if path is not None and path.exists():
        t0 = time.perf_counter()
        session = Session.load(path, engine, max_tokens=args.ctx)
        ms = (time.perf_counter() - t0) * 1e3
        # new flags apply from here on; the generator goes on where it stopped unless --seed reseeds it
        session.sampler = Sampler(params) if args.seed is not None else _with_params(session.sampler, params)
    else:
        session, ms = engine.session(sampler=params, kv_dtype=args.kv_dtype, max_tokens=args.ctx), None
    before = len(session)
    messages = list(session.meta.get("messages", []))
    if args.raw:
        rest, system = engine.tokenizer.encode(text, add_bos=None if not before else False), []
    else:
        if args.system and not messages:
            messages.append({"role": "system", "content": args.system})
        messages.append({"role": "user", "content": text})
        rest = session.reuse_prefix(engine.chat_prompt(messages))
        system = system_tokens(engine, messages) if not before else []
    if ms is not None:
        print(f"restored {before} tokens in {ms:.1f} ms, {before - len(session)} recomputed", file=sys.stderr)
    store = None if before or args.no_kv_disk else open_store(args.kv_disk_dir or default_store_dir())
    prefix = DiskPrefix(store)
    start = prefix.start(session, rest, system)
    room = session.max_tokens - len(session) - len(start.rest)
    if room < 1:
        raise ContextFull(f"the prompt needs {len(session) + len(start.rest)} tokens; the context is "
                          f"{session.max_tokens} (--ctx)")
    if args.dump_tokens:
        dump_tokens(engine, session.tokens + start.rest, len(session))
    reply, logprobs, stats = _generate(session, start.rest, args, min(args.max_tokens, room), prefix)
    prefilled = stats.prompt_tokens + start.prefilled
    seconds = stats.prefill_seconds + start.seconds
    print(f"[{prefilled} prompt tokens at {prefilled / seconds if seconds else 0:.0f} tok/s, "
          f"{stats.generated_tokens} generated at {stats.decode_tps:.1f} tok/s, finish: {stats.finish_reason}"
          + (f", {start.note}" if start.note else "") + "]", file=sys.stderr)
    if args.dump_logprobs is not None:
        dump_logprobs(engine, logprobs, len(session) - stats.generated_tokens)
    prefix.finish(session, stats.prompt_tokens)
    if path is not None:
        if not args.raw:
            messages.append({"role": "assistant", "content": reply})
            session.meta["messages"] = messages
        make_folder(path.parent)
        info = session.save(path)
        print(f"saved {len(session)} tokens ({info.bytes / 1e6:.1f} MB) in {info.seconds * 1e3:.1f} ms to {path}",
              file=sys.stderr)
    return 0


def _generate(session: Session, prompt: list[int], args, max_tokens: int, prefix: DiskPrefix
              ) -> tuple[str, list[TokenLogprob], Stats]:
    """Stream the reply to stdout (a hybrid's prefill checkpointed at its snapshot frontiers); returns its text,
    the logprobs asked for, the stats."""
    stats = Stats()
    rules = TokenRules(top_logprobs=args.dump_logprobs) if args.dump_logprobs is not None else None
    reply, logprobs = [], []
    for delta in stream(session, prompt, max_tokens=max_tokens, stop=args.stop, chunk_size=args.chunk_size,
                        stats=stats, rules=rules, speculative=args.spec == "ngram", **prefix.prefill_hooks(session)):
        reply.append(delta.text)
        logprobs.extend(delta.logprobs)
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(reply), logprobs, stats


def _with_params(sampler: Sampler, params: SamplerParams) -> Sampler:
    s = Sampler(params)
    s.rng = sampler.rng
    return s


def _piece(engine, token: int) -> str:
    return repr(engine.tokenizer.decode([token]))


def dump_tokens(engine, tokens: list[int], new_from: int) -> None:
    """Every token of the context the reply is generated from (--dump-tokens), as llama.cpp's
    --verbose-prompt lists them; positions before `new_from` were already held (session, disk)."""
    print(f"tokens: {len(tokens)} ({new_from} held or restored, {len(tokens) - new_from} to prefill)",
          file=sys.stderr)
    print(f"{'position':>8} {'id':>7}  text", file=sys.stderr)
    for pos, token in enumerate(tokens):
        print(f"{pos:>8} {token:>7}  {_piece(engine, token)}" + ("  (held)" if pos < new_from else ""),
              file=sys.stderr)


def dump_logprobs(engine, logprobs: list[TokenLogprob], first: int) -> None:
    """Each generated token's log-probability under the model and the most likely alternatives
    (--dump-logprobs N); an end-of-generation token is not fed, so it has no line."""
    print(f"{'position':>8} {'id':>7} {'logprob':>9}  token  |  most likely", file=sys.stderr)
    for i, lp in enumerate(logprobs):
        top = ", ".join(f"{_piece(engine, t)} {v:.3f}" for t, v in lp.top)
        print(f"{first + i:>8} {lp.token:>7} {lp.logprob:>9.3f}  {_piece(engine, lp.token)}" +
              (f"  |  {top}" if top else ""), file=sys.stderr)
