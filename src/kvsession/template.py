"""Chat rendering with the model's own template (tokenizer.chat_template).

The template is Jinja2, rendered in a sandbox the way Hugging Face's
apply_chat_template renders it (same globals: raise_exception, strftime_now;
same filter: tojson), so the templates shipped in GGUF files work unchanged.
"""
from __future__ import annotations

import datetime
import json
from typing import Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import TemplateError

# Used when a file carries no template. ChatML is what SmolLM2 and Qwen2 use;
# Gemma's turns (the GGUF of Gemma 3 270M ships without a template) put a
# system message in front of the first user turn and call the assistant "model".
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
DEFAULT_TEMPLATES = {"gemma3": GEMMA}

ROLES = ("system", "user", "assistant", "tool")


def _raise(message: str):
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "", arch: str = ""):
        self.source = source or DEFAULT_TEMPLATES.get(arch, CHATML)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template does not compile: {e}") from e
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise TemplateError(f"message {i}: needs a role in {ROLES} and a string content, got {m!r}")
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from e
