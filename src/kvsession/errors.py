"""Typed errors, one class per thing that can go wrong for a user.

Every error says which file or field is at fault, and, where two values
disagree, the expected and the found one. The CLI prints the
message and exits non-zero; it never shows a traceback for these.
"""
from __future__ import annotations


class KvsessionError(Exception):
    """Base of every error kvsession raises on purpose."""


class InvalidArgument(KvsessionError, ValueError):
    """A caller passed a value the function cannot take (a ValueError too, for plain Python callers)."""


# --- model files -------------------------------------------------------------


class ModelFileError(KvsessionError):
    """A model file cannot be used."""


class ModelNotFound(ModelFileError):
    pass


class NotGGUF(ModelFileError):
    pass


class CorruptModelFile(ModelFileError):
    """Truncated or otherwise unreadable GGUF."""


class UnsupportedArchitecture(ModelFileError):
    pass


class UnsupportedTensorType(ModelFileError):
    pass


class MissingTensor(ModelFileError):
    pass


# --- running a model ---------------------------------------------------------


class ContextFull(KvsessionError):
    """A token would land past the end of a full-attention cache."""


class KVBoundsError(KvsessionError, IndexError):
    """A cache primitive was asked to touch rows outside the cache, or a recurrent state to go where it cannot."""


class TemplateError(KvsessionError):
    """The chat template could not render the messages."""


# --- session files -----------------------------------------------------------


class SessionFileError(KvsessionError):
    """A session file cannot be loaded; the live session is unchanged."""


class NotASessionFile(SessionFileError):
    """Empty, not a regular file (a folder, a FIFO, ...), or not starting with the session file magic."""


class SessionNotFound(NotASessionFile):
    """No file at that path (or a symbolic link to a missing one)."""


class UnreadableSession(SessionFileError):
    """The file is there but the system refuses to read it (permission, I/O error)."""


class UnsupportedVersion(SessionFileError):
    pass


class TruncatedSession(SessionFileError):
    pass


class CorruptSession(SessionFileError):
    """A checksum or a structural field does not hold."""


class SessionMismatch(SessionFileError):
    """The file is sound but was made for another model, dtype or shape: names the field, file and model values."""

    def __init__(self, field: str, file_value, model_value, hint: str = ""):
        self.field, self.file_value, self.model_value = field, file_value, model_value
        super().__init__(f"{field}: file {file_value}, model {model_value}" + (f" ({hint})" if hint else ""))


class SessionSaveError(KvsessionError):
    """A session file could not be written or deleted (not a regular file at the path, a full disk, a read-only
    folder, ...); what was there is unchanged."""


class ManifestError(SessionFileError):
    """The raw format's sidecar manifest is missing or does not match its blob."""


class MissingManifest(ManifestError, NotASessionFile):
    """Not a session file, and no raw-format manifest beside it."""
