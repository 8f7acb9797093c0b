"""Text files a user names on the command line or in the chat (run -f, /read, perplexity -f).

One reader, so that every command says the same one line when the file is
missing, a folder, unreadable or not UTF-8 text, and `-` means standard
input everywhere.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import KvsessionError


class InputFileError(KvsessionError):
    """A named text file cannot be read as UTF-8 text."""


def read_text(name: str | os.PathLike) -> str:
    """The whole file as text; `-` is standard input. A leading ~ is the home folder."""
    if str(name) == "-":
        return _decoded(sys.stdin.buffer.read(), "standard input")
    path = Path(os.path.expanduser(str(name)))
    if not os.path.lexists(path):
        raise InputFileError(f"{path}: no such file")
    if path.is_dir():
        raise InputFileError(f"{path}: is a folder, not a file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputFileError(f"{path}: cannot read it: {e.strerror or e}") from None
    return _decoded(data, str(path))


def _decoded(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(f"{where}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None
