"""llama-server's request shapes: /completion, /infill, /tokenize, /detokenize, /apply-template, /slots.

The field names and defaults are llama-server's (tools/server of llama.cpp);
what this engine cannot do is a 400 naming the field when a request asks for
it with a value that would change the output (repeat_penalty 1.0 is asked of
every request by some clients, and does nothing), never silently ignored.
Accepted and without effect, by design: `n_indent`, `t_max_prompt_ms` and
`t_max_predict_ms` (editor plugins' heuristics and time limits; a reply stops
at its n_predict or a stop string here) and the sampler names that do
nothing at their defaults (README, "Replacing llama-server").
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from ...generate import MAX_TOP_LOGPROBS
from ..protocol import ApiError, Body, Sampling

MAX_STOPS = 16
MAX_RESPONSE_FIELDS = 64
MAX_EXTRA_CHUNKS = 4096  # input_extra's chunks (llama.vscode keeps 16 to 64); more is a 400 before any is read

# llama.cpp's sampler names (common_sampler_types_from_names) by canonical name, and its one-letter forms
SAMPLERS = ("dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc", "infill", "penalties",
            "adaptive_p")
SAMPLER_ALIASES = {"nucleus": "top_p", "temp": "temperature", "typ": "typ_p", "typical_p": "typ_p",
                   "typical": "typ_p"}
SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                 "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")

# sampling fields this engine does not have: each with the value at which it does nothing
NEUTRAL = {"typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
           "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "top_n_sigma": -1.0,
           "dynatemp_range": 0.0}


class NativeRequest(Sampling):
    """What /completion and /infill share: llama-server's generation fields."""

    n_predict: int | None = Field(None, ge=-1)  # -1: until the context ends (or an end of generation)
    max_tokens: int | None = Field(None, ge=-1)  # an alias of n_predict
    cache_prompt: bool = True
    n_probs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    post_sampling_probs: bool = False
    stop: str | list[str] | None = None
    samplers: list[str] | str | None = None
    id_slot: int = -1  # -1: any free slot
    return_tokens: bool = False
    return_progress: bool = False
    timings_per_token: bool = False
    logit_bias: list | dict | None = None
    response_fields: list[str] | None = Field(None, max_length=MAX_RESPONSE_FIELDS)
    n_keep: int = Field(0, ge=-1)  # -1: all of the prompt
    n_discard: int = Field(0, ge=0)
    grammar: str | None = None
    json_schema: dict | None = None
    n_indent: int = Field(0, ge=0)  # accepted, no effect (see the module)
    t_max_prompt_ms: int | None = None
    t_max_predict_ms: int | None = None
    typical_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    mirostat: int | None = None
    dry_multiplier: float | None = None
    xtc_probability: float | None = None
    top_n_sigma: float | None = None
    dynatemp_range: float | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        return v

    @property
    def n(self) -> int:
        """Tokens asked for: n_predict (or max_tokens); -1 when neither or -1."""
        v = self.n_predict if self.n_predict is not None else self.max_tokens
        return -1 if v is None else v

    def unsupported(self) -> None:
        for name, neutral in NEUTRAL.items():
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise ApiError(400, f"{name} {value} is not supported (only {neutral}, which does nothing)",
                               param=name)

    def sampler_names(self) -> tuple[str, ...]:
        """The samplers the request names (llama.cpp's canonical names), in its order; the default chain when it
        names none. An unknown name is a 400."""
        if self.samplers is None:
            return DEFAULT_SAMPLERS
        if isinstance(self.samplers, str):
            names = []
            for ch in self.samplers:
                if ch not in SAMPLER_CHARS:
                    raise ApiError(400, f"samplers: {ch!r} names no sampler (one of {''.join(SAMPLER_CHARS)})",
                                   param="samplers")
                names.append(SAMPLER_CHARS[ch])
            return tuple(names)
        out = []
        for name in self.samplers[:64]:
            key = name.lower().replace("-", "_")
            key = SAMPLER_ALIASES.get(key, key)
            key = next((s for s in SAMPLERS if s.replace("_", "") == key.replace("_", "")), None)
            if key is None:
                raise ApiError(400, f"samplers: {name[:40]!r} is not a sampler (one of {', '.join(SAMPLERS)})",
                               param="samplers")
            out.append(key)
        return tuple(out)


class CompletionRequest(NativeRequest):
    prompt: Any = Field(description="a string, token ids, ids and strings mixed, or a list of such prompts")


class ExtraChunk(Body):
    text: str
    filename: str = "tmp"


class InfillRequest(NativeRequest):
    input_prefix: str | list = Field(description="the text before the cursor (or token ids and strings)")
    input_suffix: str | list = Field(description="the text after the cursor")
    input_extra: list[ExtraChunk] = Field(default_factory=list, max_length=MAX_EXTRA_CHUNKS)
    prompt: str = ""  # what was typed at the cursor: it continues the prefix


class TokenizeRequest(Body):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(Body):
    tokens: list[int]


class ApplyTemplateRequest(Body):
    messages: list[dict] = Field(min_length=1)
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class SlotFile(Body):
    filename: str = Field(min_length=1, max_length=255)


SlotAction = Literal["save", "restore", "erase"]
