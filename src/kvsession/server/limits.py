"""What a request's JSON may hold, checked before any of its cost is paid: its parse, schemas, tool-call arguments.

A schema is compiled by llguidance and rendered by the chat template; a
tool call's arguments are rendered by the template. Both cost in proportion
to their size and depth, and some shapes that llguidance compiles it cannot
follow while generating: it found out only after the response had started
(a 500 mid-stream). Each limit below is one that was met:

- depth: Jinja's tojson recurses per level; Qwen2.5's template went past
  Python's recursion limit at 500 levels of a call's arguments.
- properties: llguidance's parser puts ~4 items per optional property in one
  row and allows 2,000 ("Current row has 2007 items; max is 2000" at 500
  properties, mid-stream); 400 pass.
- bytes: compile time grows with the schema, ~0.8 MB a second here; with
  a grammar's rules (the `grammar` field) it grows with the square of how
  deep they nest: a chain of 1,000 rules (24 kB) took 0.6 s, of 3,000 (76
  kB) 5.6 s, so a grammar gets a quarter of a schema's bytes.
- references: llguidance follows a `$ref` by recursing, natively, and a
  chain of 1,400 of them (14 kB) overflowed an 8 MB thread stack: the
  process died (SIGSEGV). Grammars compile on a thread with a deep stack
  (grammar.py) and a schema holds at most MAX_REFS references.
- a body of many values: json.loads' C scanner holds the GIL for all of
  it, and so the event loop (1 s for the million keys of a 14 MB
  logit_bias, /health waiting), where Python's own scanner lets the loop
  run every few milliseconds; past DENSE_VALUES the body takes that one
  (3 s of a thread), and pydantic gets no collection of more than MAX_ITEMS.

The size of a request's text against the context is the Frontend's to
check (serving.py), since it knows the context and the tokenizer.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import json.decoder
import json.scanner
import threading

from .protocol import ApiError

MAX_NESTING = 64  # JSON levels of a schema or of a tool call's arguments
MAX_SCHEMA_BYTES = 128 << 10  # one schema, as JSON
MAX_PROPERTIES = 400  # of one object in a schema
MAX_REFS = 1000  # `$ref`s in one schema: a chain of 10,000 compiled on grammar.py's stack, of 1,200 died on 8 MB
MAX_GRAMMAR_BYTES = 32 << 10  # one grammar's text (GBNF or Lark): ~1 s to compile at its worst here
DENSE_VALUES = 100_000  # commas in a body (about its values) past which Python's scanner parses it
TRIM_AFTER_BYTES = 1 << 20  # a body this big is followed by handing freed memory back (give_back_memory)
MAX_ITEMS = 1 << 18  # entries of a body's field: a logit_bias over the largest vocabulary (Gemma's 262,144) fits


def loads(raw: bytes):
    """A body's JSON. Raises ValueError (JSONDecodeError, bad UTF-8, an integer of thousands of digits) and
    RecursionError, as json.loads does."""
    if raw.count(b",") <= DENSE_VALUES:  # a few thousand values: the C scanner takes milliseconds
        return json.loads(raw)
    decoder = json.JSONDecoder(object_pairs_hook=_dict)
    decoder.parse_string = json.decoder.py_scanstring
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    with _collector_paused():
        return decoder.decode(raw.decode("utf-8"))


def give_back_memory() -> None:
    """Return the heap's free pages to the system (glibc's malloc_trim). A body of a million values is parsed on
    an executor thread, into that thread's malloc arena, and glibc gives an arena's memory back only from its
    top: after three 14 MB logit_bias bodies SmolLM2's server stayed 96 MB above idle, 50 MB with the trim (the
    rest is Python's own arenas, kept where a live object is left in one)."""
    if _libc is not None:
        _libc.malloc_trim(0)


_libc = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _libc.malloc_trim  # glibc only (musl, macOS: nothing to call)
except (OSError, AttributeError):
    _libc = None


def _dict(pairs: list) -> dict:
    """An object from its pairs a few at a time (dict(pairs), one C call, held the loop 0.2-0.5 s at a million)."""
    out = {}
    for key, value in pairs:
        out[key] = value
    return out


_paused = 0
_paused_lock = threading.Lock()


class _collector_paused:
    """The cyclic garbage collector off while a dense body is scanned: run by allocation, it walks every pair the
    scanner has made so far, and its pauses grew to 0.5 s over a million (the loop waiting); the pairs are freed
    by their counts anyway. One count for scans in parallel."""

    def __enter__(self):
        global _paused
        with _paused_lock:
            _paused += 1
            gc.disable()

    def __exit__(self, *exc):
        global _paused
        with _paused_lock:
            _paused -= 1
            if not _paused:
                gc.enable()


def nesting(value) -> int:
    """How many levels of objects and arrays `value` has (0 for a scalar); iterative, so any depth is safe."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, level = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((c, level + 1) for c in children)
    return deepest


def check_schema(schema, field: str, what: str = "the schema") -> None:
    """Refuse (400 naming `field`) a schema over a limit."""
    depth = nesting(schema)
    if depth > MAX_NESTING:
        raise ApiError(400, f"{field}: {what}: nested {depth} levels deep; at most {MAX_NESTING}", param=field)
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_BYTES:
        raise ApiError(400, f"{field}: {what}: {size:,} bytes; at most {MAX_SCHEMA_BYTES:,}", param=field)
    stack = [schema]
    refs = 0
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            props = v.get("properties")
            if isinstance(props, dict) and len(props) > MAX_PROPERTIES:
                raise ApiError(400, f"{field}: {what}: an object of {len(props)} properties; at most "
                               f"{MAX_PROPERTIES}", param=field)
            refs += "$ref" in v
            if refs > MAX_REFS:
                raise ApiError(400, f"{field}: {what}: more than {MAX_REFS:,} $ref references", param=field)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def check_grammar(grammar: str) -> None:
    """Refuse (400) a grammar over MAX_GRAMMAR_BYTES: its compile time grows with the square of its depth."""
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise ApiError(400, f"grammar: {len(grammar):,} characters; at most {MAX_GRAMMAR_BYTES:,}", param="grammar")


def check_tools(tools: list[dict] | None) -> None:
    """Refuse function tools whose parameters are over a limit: they are compiled, and rendered, with the prompt."""
    for t in tools or ():
        fn = t.get("function") or {}
        check_schema(fn.get("parameters") or {}, "tools", f"the parameters of {str(fn.get('name'))[:64]!r}")


def check_calls(messages: list[dict]) -> None:
    """Refuse a conversation whose tool calls' arguments are nested past MAX_NESTING (the template renders them)."""
    for m in messages:
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            depth = nesting(fn.get("arguments"))
            if depth > MAX_NESTING:
                raise ApiError(400, f"messages: the arguments of tool call {str(call.get('id'))[:64]!r} "
                               f"({str(fn.get('name'))[:64]}) are nested {depth} levels deep; at most {MAX_NESTING}",
                               param="messages")
