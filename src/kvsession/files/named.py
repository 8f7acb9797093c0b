"""Named sessions: a folder of NAME.kvs session files, as the chat, `run --session` and the server use it.

A name is letters, digits, '.', '_' and '-', so it cannot leave its folder.
Listing opens nothing but regular files (a FIFO would block), each only as
far as its header; deleting refuses anything that is not a regular file.
"""
from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import (
    KvsessionError,
    NotASessionFile,
    SessionFileError,
    SessionNotFound,
    SessionSaveError,
)
from . import framing
from .session_file import check_session_header

log = logging.getLogger("kvsession.files")

SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SUFFIX = ".kvs"


def sessions_dir(override: str | os.PathLike | None = None) -> Path:
    """Where named sessions live: the override, $KVSESSION_SESSIONS_DIR, else the user's data folder."""
    if override:
        return Path(override)
    if os.environ.get("KVSESSION_SESSIONS_DIR"):
        return Path(os.environ["KVSESSION_SESSIONS_DIR"])
    data = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(data) / "kvsession" / "sessions"


def check_session_name(name: str) -> str:
    """A session name: letters, digits, '.', '_', '-', at most 64, not starting with a dot or dash.

    Names never contain a path separator, so a name cannot escape its folder.
    """
    if not SESSION_NAME.fullmatch(name):
        raise InvalidSessionName(
            f"session name {name!r}: use letters, digits, '.', '_' and '-' (at most 64, starting with a letter "
            "or digit)"
        )
    return name


def session_path(name_or_path: str, folder: str | os.PathLike | None = None) -> Path:
    """NAME -> folder/NAME.kvs; anything with a path separator or ending in .kvs is a path."""
    if os.sep in name_or_path or "/" in name_or_path or name_or_path.endswith(SUFFIX):
        return Path(name_or_path)
    return sessions_dir(folder) / (check_session_name(name_or_path) + SUFFIX)


class InvalidSessionName(KvsessionError, ValueError):
    pass


def make_folder(folder: Path) -> None:
    """Create a folder for session files (and its parents), only its owner's (0700: framing.private_folder),
    rid of what saves killed mid-way left in it; SessionSaveError when that cannot be done."""
    try:
        framing.private_folder(folder)
    except OSError as e:
        raise SessionSaveError(f"cannot make the folder {folder}: {e.strerror or e}") from None
    for path in framing.remove_dead_temporaries(folder):
        log.info("removed %s, left by a save that was killed", path)


@dataclass(frozen=True)
class SavedSession:
    """A saved session as a listing shows it. A file whose header cannot be read is listed too (it can be
    loaded to see why, or deleted), with n_tokens None and the reason in `problem`."""

    name: str
    path: Path
    n_tokens: int | None
    title: str  # meta.title ("" when there is none)
    size: int  # bytes
    mtime: float
    problem: str | None = None


def list_saved(folder: str | os.PathLike) -> tuple[list[SavedSession], list[str]]:
    """The saved sessions of a folder, the most recently written first, and one warning (a line) per
    NAME.kvs that is none: a FIFO, a folder, a dangling link, a name that is not a session name.

    Nothing but regular files is opened (a FIFO would block the listing), each only as far as its
    header, and nothing is printed: the chat and the server show the result their own way. A missing
    folder holds no sessions. Dot files (the chat's history, temporaries) are not sessions.
    """
    folder = Path(folder)
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except FileNotFoundError:
        return [], []
    except OSError as e:
        return [], [f"{folder}: {e.strerror}"]
    sessions, warnings = [], []
    for entry in entries:
        if not entry.name.endswith(SUFFIX) or entry.name.startswith("."):
            continue
        path, name = Path(entry.path), entry.name[: -len(SUFFIX)]
        try:
            st = os.stat(path)
        except OSError as e:
            warnings.append(f"{path}: a symbolic link to a missing file" if entry.is_symlink() else
                            f"{path}: {e.strerror}")
            continue
        if not stat.S_ISREG(st.st_mode):
            warnings.append(f"{path}: not a regular file ({framing.file_kind(st.st_mode)})")
        elif not SESSION_NAME.fullmatch(name):
            warnings.append(f"{path}: not a session name (letters, digits, '.', '_', '-'): rename it to load it")
        else:
            sessions.append(_saved(name, path, st))
    return sorted(sessions, key=lambda s: -s.mtime), warnings


def _saved(name: str, path: Path, st: os.stat_result) -> SavedSession:
    try:
        with framing.open_regular(path) as f:
            header = framing.read_header(f, str(path))
        check_session_header(header, str(path))
    except SessionFileError as e:
        return SavedSession(name, path, None, "", st.st_size, st.st_mtime, str(e))
    fields = header.fields
    return SavedSession(name, path, fields["n_tokens"], fields["meta"].get("title", ""), st.st_size, st.st_mtime)


def delete_saved(folder: str | os.PathLike, name: str) -> None:
    """Delete the saved session NAME of a folder.

    Raises InvalidSessionName for a name that is not one, SessionNotFound when there is no such file,
    NotASessionFile when NAME.kvs is a folder, a FIFO, ... (left as it is), SessionSaveError when the
    folder refuses the deletion.
    """
    path = Path(folder) / (check_session_name(name) + SUFFIX)
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise NotASessionFile(f"{path}: not a regular file ({framing.file_kind(mode)}); not deleted")
        os.unlink(path)
    except FileNotFoundError:
        raise SessionNotFound(f"no session {name!r} in {folder}") from None
    except OSError as e:
        raise SessionSaveError(f"{path}: cannot delete: {e.strerror or e}") from None
