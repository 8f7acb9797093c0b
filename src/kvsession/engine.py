"""Engine: one loaded model file -- weights, tokenizer, chat template, fingerprint.

`Engine.load(path)` is the entry point from Python; `engine.session()` opens
a new, empty timeline on it. What a --model value names (a packaged model, a
Hub reference, a path) is resolved in catalog/packaged.py.
"""
from __future__ import annotations

import os
import time

import torch

from .catalog.packaged import default_model_path, model_path
from .errors import InvalidArgument
from .model.gguf import GGUFFile
from .model.transformer import Model
from .session import Session
from .text.template import ChatPrompt, ChatTemplate
from .text.tokenizer import Tokenizer


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Engine:
    def __init__(self, file: GGUFFile, *, device: torch.device | str | None = None, precision: str = "bf16",
                 graphs: bool | None = None):
        """graphs: decode a token at a time through graph.GraphDecoder (one CUDA graph a step); the default
        on a CUDA device, off elsewhere (on the CPU it runs eagerly: for tests)."""
        t0 = time.perf_counter()
        self.file = file
        self.path = file.path
        self.config = file.config
        self.device = torch.device(device) if device is not None else default_device()
        # a mixture's step picks its experts from the data: no one graph replays it; nor does model/cuda_graph.py
        # soft-cap or carry a recurrent state
        cfg = file.config
        self.graphs = self.device.type == "cuda" and not cfg.n_experts and not cfg.attn_softcap \
            and not cfg.recurrent if graphs is None else graphs
        if self.graphs and cfg.recurrent:
            raise InvalidArgument(f"graphs: {cfg.arch}'s recurrent layers decode layer by layer, not as CUDA graphs")
        self.model = Model(file, device=self.device, precision=precision)
        self.tokenizer = Tokenizer(file)
        self.use_template(file.meta("tokenizer.chat_template"))
        self.load_seconds = time.perf_counter() - t0

    def use_template(self, source: str | None) -> None:
        """Render chats with this Jinja template (None: the architecture's default); the file's is the first."""
        tk = self.tokenizer
        self.template = ChatTemplate(
            source,
            bos_token=tk.tokens[tk.bos_id] if tk.bos_id is not None else "",
            eos_token=tk.tokens[tk.eos_id] if tk.eos_id is not None else "",
            arch=self.config.arch,
        )

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, **kw) -> "Engine":
        """Load a GGUF file by path or packaged-model name; None: the default model."""
        return cls(GGUFFile(model_path(path) if path is not None else default_model_path()), **kw)

    @property
    def fingerprint(self):
        return self.file.fingerprint

    def session(self, **kw) -> Session:
        return Session(self, **kw)

    def chat_tokens(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Render messages with the chat template and tokenize them (BOS as the metadata says)."""
        return self.chat_prompt(messages, add_generation_prompt=add_generation_prompt).tokens

    def chat_prompt(self, messages: list[dict], *, tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, continue_final: bool = False,
                    variables: dict | None = None) -> "ChatPrompt":
        """OpenAI-style messages (and function tools) through the chat template, as text and tokens.

        Control-token text inside message contents, tool arguments, results, definitions and template variables
        is tokenized as plain text; everything else exactly as tokenizer.encode(text) does. continue_final: the
        last message is an assistant turn whose text the reply continues. variables: the template's own
        (`enable_thinking`, `reasoning_effort`). Raises TemplateError for malformed messages."""
        r = self.template.render_guarded(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         continue_final=continue_final, variables=variables,
                                         control=self.tokenizer.control_pattern)
        return ChatPrompt(r.text, self.tokenizer.encode_guarded(r.text, r.literals), r.literals)
