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
listing skips.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from tqdm import tqdm

from .errors import KvsessionError, SessionNotFound
from .generate import Stats, stream
from .sampling import SamplerParams
from .named import check_session_name, list_saved, make_folder, sessions_dir
from .session import Session

HELP = """commands:
  /help              this list
  /save [NAME]       save the session (as NAME; default: its current name)
  /load NAME         load a saved session (no prefill)
  /list              saved sessions: name, title, tokens, bytes, last used
  /switch PREFIX     load the session whose name starts with PREFIX
  /new               start an empty session
  /system TEXT       set the system message (of a new conversation)
  /ctx N             limit the context to N tokens
  /temp T            sampling temperature (0: greedy)
  /rewind N          drop the last N turns (the cache is cut back, nothing is recomputed)
  /quit              leave (Ctrl+D too); Ctrl+C stops a reply
"""

PROGRESS_TOKENS = 256  # prefills longer than this get a progress bar
PROGRESS_BYTES = 32 << 20  # so do saves and loads of bigger files
HISTORY = ".chat_history"  # in the sessions folder, never beside it


class Chat:
    def __init__(self, engine, folder: Path, *, sampler: SamplerParams, max_tokens: int, kv_dtype: str,
                 out=sys.stdout):
        self.engine = engine
        self.folder = folder
        self.params = sampler
        self.max_tokens = max_tokens  # per reply
        self.kv_dtype = kv_dtype
        self.out = out
        self.name: str | None = None
        self.dirty = False  # turns not yet saved
        self.session = self._new_session()
        self._stop = False

    # --- state ------------------------------------------------------------------------

    def _new_session(self) -> Session:
        s = self.engine.session(sampler=self.params, kv_dtype=self.kv_dtype)
        s.meta = {"messages": [], "turns": []}
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
        reused = len(s)
        room = s.max_tokens - reused - len(prompt)
        if room < 1:
            self.messages.pop()
            raise KvsessionError(f"the context would exceed {s.max_tokens} tokens; /rewind, /new or /ctx")
        stats = Stats()
        bar = tqdm(total=len(prompt), unit="tok", desc="prefill", leave=False, file=sys.stderr) \
            if len(prompt) > PROGRESS_TOKENS else None

        def progress(done: int, total: int) -> None:
            if bar is not None:
                bar.update(done - bar.n)
            if self._stop:  # between prefill chunks the session is consistent: stop here
                raise _Stopped

        reply = []
        try:
            for delta in stream(s, prompt, max_tokens=min(self.max_tokens, room), stats=stats, progress=progress):
                if bar is not None:
                    bar.close()
                    bar = None
                reply.append(delta.text)
                self.out.write(delta.text)
                self.out.flush()
                if self._stop:
                    break
        except _Stopped:  # during the prefill: the turn did not happen; the next one cuts the cache back
            self.messages.pop()
            self.say("^C (stopped before the reply)")
            return
        finally:
            if bar is not None:
                bar.close()
        if len(self.messages) == 1 or (len(self.messages) == 2 and self.messages[0]["role"] == "system"):
            s.meta["title"] = text[:60]
        self.messages.append({"role": "assistant", "content": "".join(reply)})
        self.turns.append(len(s))
        self.dirty = True
        stopped = " · stopped" if self._stop else ""
        self.say()
        self.say(f"[{len(s)} tokens in context · {reused} reused · {held - reused} recomputed · "
                 f"{stats.prompt_tokens} prefilled at {stats.prefill_tps:.0f} tok/s · "
                 f"{stats.generated_tokens} generated at {stats.decode_tps:.1f} tok/s{stopped}]")

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

    def cmd_save(self, arg: str) -> None:
        name = check_session_name(arg) if arg else self.name
        if name is None:
            raise KvsessionError("/save needs a NAME the first time")
        make_folder(self.folder)
        path = self.folder / (name + ".kvs")
        t0 = time.perf_counter()
        size = sum(layer.row_nbytes * 2 * layer.end for layer in self.session.cache)
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
            session = Session.load(path, self.engine, progress=(lambda done, total: bar.update(
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
        self.session.max_tokens = n
        for layer in self.session.cache:
            if not layer.ring:
                layer.max_capacity = n
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
        keep = turns[-n - 1] if n < len(turns) else 0
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


class _Stopped(Exception):
    """Ctrl+C between prefill chunks."""


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


def run(engine, args) -> int:
    """The REPL loop: one line a turn or a /command; errors are one line and the loop goes on."""
    try:
        import readline  # line editing and history
    except ImportError:  # not on every platform; the chat works without it
        readline = None
    folder = sessions_dir(args.sessions_dir)
    history = folder / HISTORY
    if readline is not None and history.is_file():  # a regular file: a FIFO there would block the start
        try:
            readline.read_history_file(history)
        except OSError:
            pass
    sampler = SamplerParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed)
    chat = Chat(engine, folder, sampler=sampler, max_tokens=args.max_tokens, kv_dtype=args.kv_dtype)
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
                history.parent.mkdir(parents=True, exist_ok=True)
                readline.write_history_file(history)
            except OSError:
                pass
    return 0
