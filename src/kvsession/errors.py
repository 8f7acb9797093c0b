"""Typed errors, one class per thing that can go wrong for a user.

Every error says which file or field is at fault, and, where two values
disagree, the expected and the found one (STYLE.md rule 8). The CLI prints the
message and exits non-zero; it never shows a traceback for these.
"""
from __future__ import annotations


class KvsessionError(Exception):
    """Base of every error kvsession raises on purpose."""


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


class TemplateError(KvsessionError):
    """The chat template could not render the messages."""
