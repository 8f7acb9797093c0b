"""What a JSON value read from a file must be, and the one check that says where it is not.

A header's checksum proves its bytes are the ones written, not that
kvsession wrote them, so every JSON document a file holds (a session
header, a store manifest, a raw manifest, a sidecar) is type-checked field
by field before use. A Spec says what one value must be (`Int(0, 10)`,
`ListOf(Str())`, `Obj({...})`); `check_json` raises a typed error naming the
first field that differs, in one line, however large or deep the value.

This module knows JSON values only: which documents carry which fields is
the business of the formats that use it (files/framing.py, files/session_file.py,
store/layout.py).
"""
from __future__ import annotations

import math
import reprlib

from ..errors import CorruptSession

HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


class _Mismatch(Exception):
    def __init__(self, field: str, problem: str):
        super().__init__(field, problem)
        self.field, self.problem = field, problem


_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlist, _short.maxdict, _short.maxlevel = 40, 40, 4, 4, 2


def short(v) -> str:
    """A value as an error message shows it: a few dozen characters, however large or deep the value."""
    return _short.repr(v)


def _join(field: str, key) -> str:
    return f"{field}[{key}]" if isinstance(key, int) else f"{field}.{key}" if field else str(key)


class Spec:
    """What a JSON value must be. Subclasses say it in `what` and test it in `holds`."""

    what = "a value"

    def holds(self, v) -> bool:
        raise NotImplementedError

    def check(self, v, field: str) -> None:
        if not self.holds(v):
            raise _Mismatch(field, f"expected {self.what}, found {short(v)}")


class Int(Spec):
    """A whole number (never a float or a bool) in [lo, hi]."""

    def __init__(self, lo: int = 0, hi: int | None = None):
        self.lo, self.hi = lo, hi
        self.what = f"a whole number >= {lo}" if hi is None else f"a whole number from {lo} to {hi}"

    def holds(self, v) -> bool:
        return type(v) is int and self.lo <= v and (self.hi is None or v <= self.hi)


class Num(Spec):
    """A finite number (never a bool) in [lo, hi]."""

    def __init__(self, lo: float = -math.inf, hi: float = math.inf, what: str = "a finite number"):
        self.lo, self.hi, self.what = lo, hi, what

    def holds(self, v) -> bool:
        return type(v) in (int, float) and math.isfinite(v) and self.lo <= v <= self.hi


class Str(Spec):
    what = "a string"

    def holds(self, v) -> bool:
        return isinstance(v, str)


class Hex(Spec):
    def __init__(self, digits: int):
        self.digits, self.what = digits, f"{digits} hex digits"

    def holds(self, v) -> bool:
        return isinstance(v, str) and len(v) == self.digits and HEX_DIGITS.issuperset(v)


class Bool(Spec):
    what = "true or false"

    def holds(self, v) -> bool:
        return type(v) is bool


class OneOf(Spec):
    def __init__(self, *values: str):
        self.values, self.what = values, "one of " + ", ".join(map(repr, values))

    def holds(self, v) -> bool:
        return isinstance(v, str) and v in self.values


class AnyJSON(Spec):
    """Any JSON value nested at most `depth` deep: deeper ones would break json.dumps when the file is saved again."""

    def __init__(self, depth: int = 32):
        self.depth, self.what = depth, f"JSON nested at most {depth} deep"

    def holds(self, v, left: int | None = None) -> bool:
        left = self.depth if left is None else left
        if not isinstance(v, (list, dict)):
            return True
        return left > 0 and all(self.holds(x, left - 1) for x in (v.values() if isinstance(v, dict) else v))


class Either(Spec):
    def __init__(self, *specs: Spec):
        self.specs, self.what = specs, " or ".join(s.what for s in specs)

    def holds(self, v) -> bool:
        return any(s.holds(v) for s in self.specs)


class Null(Spec):
    what = "null"

    def holds(self, v) -> bool:
        return v is None


class ListOf(Spec):
    def __init__(self, item: Spec, length: int | None = None):
        self.item, self.length = item, length
        self.what = "a list" if length is None else f"a list of {length}"

    def holds(self, v) -> bool:
        return isinstance(v, list) and (self.length is None or len(v) == self.length)

    def check(self, v, field: str) -> None:
        super().check(v, field)
        for i, x in enumerate(v):
            self.item.check(x, _join(field, i))


class Obj(Spec):
    """An object with these keys (and `optional` ones); other keys are allowed (later versions add fields),
    checked against `extra` when given, refused when `closed`."""

    what = "an object"

    def __init__(self, required: dict[str, Spec], optional: dict[str, Spec] | None = None, *,
                 extra: Spec | None = None, closed: bool = False):
        self.required, self.optional, self.extra, self.closed = required, optional or {}, extra, closed

    def holds(self, v) -> bool:
        return isinstance(v, dict)

    def check(self, v, field: str) -> None:
        super().check(v, field)
        for key, spec in self.required.items():
            if key not in v:
                raise _Mismatch(_join(field, key), "missing")
            spec.check(v[key], _join(field, key))
        for key, value in v.items():
            if key in self.required:
                continue
            spec = self.optional.get(key, self.extra)
            if spec is None and self.closed:
                raise _Mismatch(field, f"unexpected field {short(key)}")
            if spec is not None:
                spec.check(value, _join(field, key))


def check_json(value, spec: Spec, where: str, *, field: str = "", what: str = "header field",
               error=CorruptSession) -> None:
    """Raise `error` naming the first field of `value` (itself at `field`) that does not match `spec`:
    one line, whatever the value."""
    try:
        spec.check(value, field)
    except _Mismatch as m:
        raise error(f"{where}: {what} {m.field}: {m.problem}" if m.field else f"{where}: {what}: {m.problem}") from None
