"""`kvsession chat`: a terminal chat whose sessions live on disk.

As in ds4's agent, the session file is the conversation: /load and /switch
read it and go on, without a token of prefill. The live session stays in
memory across turns, so turn n+1 prefills only its own tokens; every turn
ends with a status line saying how many tokens the context holds and how
many were reused.

Ctrl+C during a reply stops the reply: a SIGINT handler only raises a flag,
which the decode loop checks between tokens, so the session is never caught
between a forward pass and its bookkeeping. Ctrl+C at the prompt clears the
line; Ctrl+D or /quit leaves, offering to save a session with unsaved turns.

The sessions folder is listed by named.list_saved (the server lists it
the same way); the readline history lives in it too, as a dot file the
listing skips. Tab completes commands, session names after /load, /switch
and /save, and file names after /read.

A new conversation starts from the disk KV cache (diskprefix.py): its system
prompt, checkpointed the first time it was prefilled, is restored instead of
prefilled. When a turn would leave too little room for a reply, the chat
offers to drop the oldest turns, as ds4's agent compacts: the conversation is
rendered again without them, the cache is cut back to where the two
renderings part (the system prompt stays) and only what follows is prefilled.
"""
from __future__ import annotations

import glob
import os
import signal
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ..errors import KvsessionError, SessionNotFound
from ..files import framing
from ..files.named import check_session_name, list_saved, make_folder, sessions_dir
from ..generate import Stats, stream
from ..sampling import SamplerParams
from ..session import Session
from ..store import default_store_dir
from .diskprefix import DiskPrefix, Start, open_store, system_tokens
from .textfile import read_text

HELP = """commands:
  /help              this list
  /save [NAME]       save the session (as NAME; default: its current name)
  /load NAME         load a saved session (no prefill)
  /list              saved sessions: name, title, tokens, bytes, last used
  /switch PREFIX     load the session whose name starts with PREFIX
  /new               start an empty session
  /system TEXT       set the system message (of this conversation and the next ones)
  /ctx N             limit the context to N tokens
  /temp T            sampling temperature (0: greedy)
  /rewind N          drop the last N turns (the cache is cut back, nothing is recomputed)
  /read FILE         send the file's text as your next message
  /history [N]       the last N turns (default: all), a line per message
  /quit, /exit       leave (Ctrl+D too); Ctrl+C stops a reply
Tab completes commands, session names and file names."""

PROGRESS_TOKENS = 256  # prefills longer than this get a progress bar
PROGRESS_BYTES = 32 << 20  # so do saves and loads of bigger files
HISTORY = ".chat_history"  # in the sessions folder, never beside it
HISTORY_WIDTH = 100  # characters of a message shown by /history


class Chat:
    def __init__(self, engine, folder: Path, *, sampler: SamplerParams, max_tokens: int, kv_dtype: str,
                 ctx: int | None = None, prefix: DiskPrefix | None = None, out=sys.stdout, speculative: bool = False):
        self.engine = engine
        self.speculative = speculative  # drafts from the conversation (speculative.py)
        self.folder = folder
        self.params = sampler
        self.max_tokens = max_tokens  # per reply
        self.kv_dtype = kv_dtype
        self.ctx = ctx  # of every session; None: the model's
        self.prefix = prefix or DiskPrefix(None)
        self.system: str | None = None  # the system message of every new conversation (/system sets it)
        self.out = out
        self.name: str | None = None
        self.dirty = False  # turns not yet saved
        self.session = self._new_session()
        self._stop = False

    # --- state ------------------------------------------------------------------------

    def _new_session(self) -> Session:
        s = self.engine.session(sampler=self.params, kv_dtype=self.kv_dtype, max_tokens=self.ctx)
        s.meta = {"messages": [{"role": "system", "content": self.system}] if self.system else [], "turns": []}
        return s

    @property
    def messages(self) -> list[dict]:
        return self.session.meta.setdefault("messages", [])

    @property
    def turns(self) -> list[int]:
        """Tokens the session held at the end of each completed turn."""
        return self.session.meta.setdefault("turns", [])

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    # --- a turn -------------------------------------------------------------------------

    def turn(self, text: str) -> None:
        """One user turn; Ctrl+C anywhere in it only raises the stop flag (see the module's note)."""
        self._stop = False
        previous = signal.signal(signal.SIGINT, self._interrupt)
        try:
            self._turn(text)
        finally:
            signal.signal(signal.SIGINT, previous)

    def _turn(self, text: str) -> None:
        s = self.session
        held = len(s)
        self.messages.append({"role": "user", "content": text})
        prompt = s.reuse_prefix(self.engine.chat_prompt(self.messages))
        own = len(prompt) - (held - len(s))  # this turn's tokens; the rest of the prompt was computed before
        notes = []
        stats = Stats()
        try:
            prompt = self._fit(prompt, notes)
            reused = len(s)
            room = s.max_tokens - reused - len(prompt)
            if room < 1:
                self.messages.pop()
                raise KvsessionError(f"the context would exceed {s.max_tokens} tokens; /rewind, /new or /ctx")
            start = self.prefix.start(s, prompt, system_tokens(self.engine, self.messages) if not reused else ())
            reply = self._reply(start.rest, min(self.max_tokens, room), stats)
        except _Stopped:  # before the reply: the turn did not happen; the next one cuts the cache back
            self.messages.pop()
            self.say("^C (stopped before the reply)")
            return
        if len(self.messages) == 1 or (len(self.messages) == 2 and self.messages[0]["role"] == "system"):
            s.meta["title"] = text[:60]
        self.messages.append({"role": "assistant", "content": reply})
        self.turns.append(len(s))
        self.dirty = True
        self.prefix.finish(s, stats.prompt_tokens)
        notes += [start.note] if start.note else []
        notes += ["stopped"] if self._stop else []
        self.say()
        self.say(_status(len(s), reused, max(0, len(prompt) - start.restored - own), start, stats, notes))

    def _reply(self, prompt: list[int], max_tokens: int, stats: Stats) -> str:
        """Prefill the prompt and stream the reply to the terminal; Ctrl+C stops it (see _interrupt)."""
        bar = tqdm(total=len(prompt), unit="tok", desc="prefill", leave=False, file=sys.stderr) \
            if len(prompt) > PROGRESS_TOKENS else None

        def progress(done: int, total: int) -> None:
            if bar is not None:
                bar.update(done - bar.n)
            if self._stop:  # between prefill chunks the session is consistent: stop here
                raise _Stopped

        reply = []
        try:
            for delta in stream(self.session, prompt, max_tokens=max_tokens, stats=stats, speculative=self.speculative,
                                **self.prefix.prefill_hooks(self.session, progress)):
                if bar is not None:
                    bar.close()
                    bar = None
                reply.append(delta.text)
                self.out.write(delta.text)
                self.out.flush()
                if self._stop:
                    break
        finally:
            if bar is not None:
                bar.close()
        return "".join(reply)

    def _fit(self, prompt: list[int], notes: list[str]) -> list[int]:
        """When the turn would leave less room for the reply than min(max tokens, a quarter of the context),
        offer to drop the oldest turns; returns the tokens to prefill."""
        s = self.session
        want = min(self.max_tokens, s.max_tokens // 4)
        need = len(s) + len(prompt)
        if s.max_tokens - need >= want:
            return prompt
        n = self._turns_to_drop(want)
        if n is None:
            return prompt
        yes = self._ask(f"the context is full ({need} of {s.max_tokens} tokens with this message); "
                        f"drop the oldest {n} turn{'s' * (n > 1)}? [Y/n] ")
        if self._stop:  # Ctrl+C at the question (the turn's handler only raised the flag)
            raise _Stopped
        if not yes:
            return prompt
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        del self.messages[users[0] : users[n]]
        prompt = s.reuse_prefix(self.engine.chat_prompt(self.messages))
        self._recount_turns()
        notes.append(f"dropped the oldest {n} turn{'s' * (n > 1)}")
        return prompt

    def _turns_to_drop(self, want: int) -> int | None:
        """The fewest oldest turns whose removal leaves `want` tokens of room, or None when none does."""
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        for n in range(1, len(users)):
            kept = self.messages[: users[0]] + self.messages[users[n]:]
            if len(self.engine.chat_prompt(kept).tokens) + want <= self.session.max_tokens:
                return n
        return None

    def _recount_turns(self) -> None:
        """Where each completed turn ends in the conversation as rendered now (after turns were dropped):
        the length of its rendering up to its reply, left open as the session held it."""
        ends = [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]
        self.turns[:] = [len(self.engine.chat_prompt(self.messages[: i + 1], continue_final=True).tokens)
                         for i in ends]

    def _ask(self, question: str) -> bool:
        try:
            answer = input(question).strip().lower()
        except EOFError:
            return False
        return answer in ("", "y", "yes")

    def _interrupt(self, signum, frame) -> None:
        self._stop = True

    # --- commands -----------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run a /command; False means leave."""
        name, _, arg = line[1:].partition(" ")
        arg = arg.strip()
        handler = getattr(self, f"cmd_{name}", None)
        if handler is None or not name.isidentifier():
            raise KvsessionError(f"unknown command /{name}; /help lists them")
        return handler(arg) is not False

    def cmd_help(self, arg: str) -> None:
        self.say(HELP.rstrip())

    def cmd_quit(self, arg: str) -> bool:
        self.offer_save()
        return False

    def cmd_exit(self, arg: str) -> bool:
        return self.cmd_quit(arg)

    def cmd_read(self, arg: str) -> None:
        if not arg:
            raise KvsessionError("/read needs a FILE")
        text = read_text(arg)
        if not text.strip():
            raise KvsessionError(f"{arg}: the file holds no text")
        n = len(self.engine.tokenizer.encode(text, add_bos=False, special=False))
        self.say(f"read {arg}: {len(text.encode('utf-8')):,} bytes, {n:,} tokens")
        self.turn(text)

    def cmd_history(self, arg: str) -> None:
        n = _number(arg, int, "/history [N]") if arg else None
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        if n is not None and n < 1:
            raise KvsessionError("usage: /history [N], N >= 1")
        first = users[-n] if n is not None and n < len(users) else 0
        if not self.messages:
            self.say("no messages yet")
        for m in self.messages[first:]:
            text = _printable(" ".join((m["content"] or "").split()))  # one line a message
            if len(text) > HISTORY_WIDTH:
                text = text[: HISTORY_WIDTH - 3] + "..."
            self.say(f"{m['role']:<10} {text}")

    def cmd_save(self, arg: str) -> None:
        name = check_session_name(arg) if arg else self.name
        if name is None:
            raise KvsessionError("/save needs a NAME the first time")
        make_folder(self.folder)
        path = self.folder / (name + ".kvs")
        t0 = time.perf_counter()
        size = self.session.kv_bytes
        with _bar(size, "save") as bar:
            info = self.session.save(path, progress=(lambda done, total: bar.update(done - bar.n)) if bar else None)
        self.name, self.dirty = name, False
        self.say(f"saved {name}: {len(self.session)} tokens, {info.bytes / 1e6:.1f} MB in "
                 f"{(time.perf_counter() - t0) * 1e3:.1f} ms")

    def cmd_load(self, arg: str) -> None:
        if not arg:
            raise KvsessionError("/load needs a NAME; /list shows them")
        name = check_session_name(arg)
        path = self.folder / (name + ".kvs")
        if not os.path.lexists(path):
            raise SessionNotFound(f"no session {name!r} in {self.folder}; /list shows them")
        t0 = time.perf_counter()
        with _bar(_size(path), "load") as bar:
            session = Session.load(path, self.engine, max_tokens=self.ctx, progress=(lambda done, total: bar.update(
                int(bar.total * done / total) - bar.n)) if bar else None)
        ms = (time.perf_counter() - t0) * 1e3
        session.sampler = type(session.sampler)(self.params) if session.sampler.params != self.params \
            else session.sampler
        session.meta.setdefault("messages", [])
        session.meta.setdefault("turns", [])
        self.offer_save()  # only now: a file that does not load leaves everything as it was
        self.session, self.name, self.dirty = session, name, False
        self.say(f"loaded {name}: {len(session)} tokens in {ms:.1f} ms, 0 recomputed"
                 f" ({len(self.messages)} messages)")

    def cmd_switch(self, arg: str) -> None:
        names = sorted(s.name for s in list_saved(self.folder)[0] if s.name.startswith(arg))
        if len(names) != 1:
            raise KvsessionError(f"{len(names)} sessions start with {arg!r}" +
                                 (f": {', '.join(names)}" if names else "; /list shows them"))
        self.cmd_load(names[0])

    def cmd_list(self, arg: str) -> None:
        sessions, warnings = list_saved(self.folder)
        for warning in warnings:
            self.say(f"warning: {_printable(warning)}")
        if not sessions:
            self.say(f"no saved sessions in {self.folder}")
        for s in sessions:
            mark = "*" if s.name == self.name else " "
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.mtime))
            title = _printable(s.title if s.problem is None else f"(unreadable: {s.problem})")
            tokens = "?" if s.n_tokens is None else s.n_tokens
            self.say(f"{mark} {s.name:<20} {title[:40]:<40} {tokens:>7} tok {s.size / 1e6:>7.1f} MB  {when}")

    def cmd_new(self, arg: str) -> None:
        self.offer_save()
        self.session, self.name, self.dirty = self._new_session(), None, False
        self.say("new session")

    def cmd_system(self, arg: str) -> None:
        if not arg:
            raise KvsessionError("/system needs the TEXT of the system message")
        self.system = arg
        msgs = self.messages
        if msgs and msgs[0]["role"] == "system":
            msgs[0]["content"] = arg
        else:
            msgs.insert(0, {"role": "system", "content": arg})
        self.dirty = True
        self.say("system message set" + (" (the next turn recomputes the conversation)" if len(msgs) > 1 else ""))

    def cmd_ctx(self, arg: str) -> None:
        n = _number(arg, int, "/ctx N")
        if n < max(1, len(self.session)) or n > self.engine.config.context_length:
            raise KvsessionError(f"/ctx {n}: between {max(1, len(self.session))} (the session) and "
                                 f"{self.engine.config.context_length} (the model)")
        self.session.limit_context(n)
        self.ctx = n  # sessions opened from now on too
        self.say(f"context limited to {n} tokens")

    def cmd_temp(self, arg: str) -> None:
        t = _number(arg, float, "/temp T")
        try:
            self.params = SamplerParams(temperature=t, top_k=self.params.top_k, top_p=self.params.top_p,
                                        min_p=self.params.min_p, seed=self.params.seed)
        except ValueError as e:
            raise KvsessionError(str(e)) from None
        rng = self.session.sampler.rng
        self.session.sampler = type(self.session.sampler)(self.params)
        self.session.sampler.rng = rng
        self.say(f"temperature {t:g}")

    def cmd_rewind(self, arg: str) -> None:
        n = _number(arg or "1", int, "/rewind N")
        turns = self.turns
        if not 1 <= n <= len(turns):
            raise KvsessionError(f"/rewind {n}: the session has {len(turns)} turns")
        # at most what the session holds: a reply stopped during its prefill may have left less
        keep = min(turns[-n - 1] if n < len(turns) else 0, len(self.session))
        self.session.truncate(keep)  # a ring that has moved on refuses, and nothing changes
        del turns[-n:]
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        del self.messages[users[-n]:]
        self.dirty = True
        self.say(f"rewound {n} turn{'s' * (n > 1)}: {len(self.session)} tokens in context")

    # --- files ----------------------------------------------------------------------------

    def offer_save(self) -> None:
        """Before unsaved turns are dropped: y saves the session under its name, n discards it, another
        answer is the name to save it as. Enter means y when the session has a name, else n."""
        if not self.dirty or not len(self.session):
            return
        question = (f"save this session first? y: as {self.name}, n: discard, or a new name [y]: " if self.name
                    else "save this session first? n: discard, or a name to save it as [n]: ")
        while True:
            try:
                answer = input(question).strip()
            except EOFError:
                answer = "n"
            if answer.lower() in ("n", "no") or not (answer or self.name):
                self.say("(not saved)")
                return
            if answer.lower() in ("", "y", "yes") and not self.name:
                self.say("a name, please (or n)")
                continue
            try:
                self.cmd_save(self.name if answer.lower() in ("", "y", "yes") else answer)
                return
            except KvsessionError as e:  # a bad name, a full disk: ask again rather than lose the session
                self.say(f"error: {e}")


COMMANDS = tuple(f"/{name[4:]}" for name in dir(Chat) if name.startswith("cmd_"))


class _Stopped(Exception):
    """Ctrl+C before the reply: between prefill chunks, or at the question of _fit."""


def _status(n: int, reused: int, recomputed: int, start: Start, stats: Stats, notes: list[str]) -> str:
    """The line after a turn: context, what was reused, recomputed, prefilled (here and in DiskPrefix.start)."""
    prefilled = start.prefilled + stats.prompt_tokens
    seconds = start.seconds + stats.prefill_seconds
    return (f"[{n} tokens in context · {reused} reused · {recomputed} recomputed · {prefilled} prefilled at "
            f"{prefilled / seconds if seconds else 0:.0f} tok/s · {stats.generated_tokens} generated at "
            f"{stats.decode_tps:.1f} tok/s" + "".join(f" · {note}" for note in notes) + "]")


def _bar(total: int, desc: str):
    if total < PROGRESS_BYTES:
        class _NoBar:
            def __enter__(self):
                return None

            def __exit__(self, *exc):
                return False
        return _NoBar()
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False, file=sys.stderr)


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:  # Session.load says what is wrong with it
        return 0


def _printable(text: str) -> str:
    """Text from a file, safe to print: a newline or an escape sequence would garble the listing."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _number(arg: str, kind, usage: str):
    try:
        return kind(arg)
    except ValueError:
        raise KvsessionError(f"usage: {usage}") from None


def completions(chat: Chat, line: str, word: str) -> list[str]:
    """What Tab offers for `word`, the last word of `line`: a command at the start of the line, a session
    name after /load, /switch and /save, a file name after /read."""
    if line == word:  # with the space readline does not add (Python's readline appends nothing)
        return sorted(c + " " for c in COMMANDS if c.startswith(word))
    command = line.split(maxsplit=1)[0]
    if command in ("/load", "/switch", "/save"):
        return sorted(s.name for s in list_saved(chat.folder)[0] if s.name.startswith(word))
    if command == "/read":
        return sorted(p + ("/" if os.path.isdir(p) else "")
                      for p in glob.glob(glob.escape(os.path.expanduser(word)) + "*"))
    return []


def _set_up_readline(readline, chat: Chat, history: Path) -> None:
    if history.is_file():  # a regular file: a FIFO there would block the start
        try:
            readline.read_history_file(history)
        except OSError:
            pass
    found: list[str] = []

    def complete(word: str, state: int) -> str | None:
        if state == 0:  # readline asks for state 0, 1, ... until None: compute the list once
            found[:] = completions(chat, readline.get_line_buffer()[: readline.get_endidx()].lstrip(), word)
        return found[state] if state < len(found) else None

    readline.set_completer(complete)
    readline.set_completer_delims(" \t\n")  # "/" and "." belong to commands and names
    readline.parse_and_bind("bind ^I rl_complete" if "libedit" in (readline.__doc__ or "") else "tab: complete")


def run(engine, args) -> int:
    """The REPL loop: one line a turn or a /command; errors are one line and the loop goes on."""
    try:
        import readline  # line editing and history
    except ImportError:  # not on every platform; the chat works without it
        readline = None
    folder = sessions_dir(args.sessions_dir)
    history = folder / HISTORY
    sampler = SamplerParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed)
    store = None if args.no_kv_disk else open_store(args.kv_disk_dir or default_store_dir())
    chat = Chat(engine, folder, sampler=sampler, max_tokens=args.max_tokens, kv_dtype=args.kv_dtype, ctx=args.ctx,
                prefix=DiskPrefix(store), speculative=args.spec == "ngram")
    if readline is not None:
        _set_up_readline(readline, chat, history)
    chat.say(f"kvsession chat · {engine.path.name} · sessions in {folder} · /help for commands")
    if args.session:
        try:
            chat.cmd_load(args.session)
        except SessionNotFound:
            chat.name = check_session_name(args.session)
            chat.say(f"new session {args.session}")
    if args.system:
        chat.cmd_system(args.system)
    try:
        while True:
            try:
                line = input("> ").strip()
            except KeyboardInterrupt:
                chat.say("^C")
                continue
            except EOFError:
                chat.say()
                chat.offer_save()
                break
            if not line:
                continue
            try:
                if line.startswith("/"):
                    if not chat.command(line):
                        break
                else:
                    chat.turn(line)
            except KvsessionError as e:
                chat.say(f"error: {e}")
            except KeyboardInterrupt:  # during a command: files are written whole or not at all
                chat.say("^C")
    finally:
        if readline is not None:
            try:
                framing.private_folder(history.parent)
                readline.write_history_file(history)
                os.chmod(history, 0o600)  # the lines typed: as private as the sessions beside it
            except OSError:
                pass
    return 0
