"""llama-server's native completions: the work of /completion (and /completions) and /infill, and their answers.

A request becomes a worker Generation through the serving object, as every
other API's does (the same live and disk prefix reuse, the same running
set); only the prompt (token ids and strings mixed, or a fill-in-the-middle
layout: infill.py) and the answer's shape are llama-server's: `content`,
`tokens`, `stop_type`, `timings`, `generation_settings`,
`completion_probabilities`, streamed as `data:` lines without a closing
[DONE], and `response_fields` picking paths out of the answer.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from fastapi import Request

from ...generate import TokenLogprob
from ...text.template import ChatPrompt
from ..events import ChoiceEnd, Done, Output, Progress, Started
from ..http.sse import StreamRenderer, sse_data, stream
from ..protocol import ApiError
from ..request_fields import session_key, stops
from ..serving import Frontend
from ..events import Generation
from .protocol import NativeRequest
from .telemetry import prompt_progress, timings

MAX_PROMPTS = 16  # prompts in one request's list
LOWEST = -3.4028234663852886e38  # llama-server's log of a zero probability (JSON has no -inf)
STOP_TYPES = {"length": "limit", None: "none"}


async def prompts(fe: Frontend, value: Any, field: str = "prompt", most: int = MAX_PROMPTS) -> list[ChatPrompt]:
    """The request's prompts (its `field`), tokenized: one (a string, {"prompt_string": ...}, {"content": [text
    parts]}, or token ids and strings mixed) or a list of at most `most` of those; strings as llama-server reads
    them (control tokens parsed, a BOS where the model wants one before a leading string)."""
    if isinstance(value, list) and value and not any(_is_id(x) for x in value):
        many = [_pieces(p, field) for p in value[: most + 1]]
        if len(value) > most:
            raise ApiError(400, f"{field}: {len(value)} prompts; at most {most} in one request", param=field)
    else:
        many = [_pieces(value, field)]
    fe.check_length(sum(len(x) if isinstance(x, str) else 1 for pieces in many for x in pieces), field)
    n_vocab = fe.engine.config.vocab_size
    bad = next((x for pieces in many for x in pieces if _is_id(x) and not 0 <= x < n_vocab), None)
    if bad is not None:
        raise ApiError(400, f"{field}: token {bad} is outside the vocabulary of {n_vocab}", param=field)
    return await fe.off_loop(lambda: [_tokenized(fe, pieces, field) for pieces in many])


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _pieces(value: Any, field: str) -> list[int | str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        if "multimodal_data" in value:
            raise ApiError(400, f"{field}: multimodal data is not supported (this server serves text models)",
                           param=field)
        if "content" in value:  # OpenAI-style content parts: their texts, one after the other
            parts = value["content"]
            if not isinstance(parts, list) or not parts or not all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
                raise ApiError(400, f"{field}: an object's content is a list of text parts (this server serves "
                               "text models)", param=field)
            return ["".join(p["text"] for p in parts)]
        text = value.get("prompt_string")
        if not isinstance(text, str):
            raise ApiError(400, f"{field}: an object prompt needs a string prompt_string", param=field)
        return [text]
    if isinstance(value, list) and value and all(_is_id(x) or isinstance(x, str) for x in value):
        return value
    raise ApiError(400, f"{field}: a string, a list of token ids (and strings), or a list of such prompts",
                   param=field)


def _tokenized(fe: Frontend, pieces: list[int | str], field: str) -> ChatPrompt:
    tk = fe.engine.tokenizer
    tokens: list[int] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            tokens += tk.encode(piece, add_bos=None if i == 0 else False)
        else:
            tokens.append(piece)
    if not tokens:
        raise ApiError(400, f"{field}: empty", param=field)
    return ChatPrompt(tk.decode(tokens), tokens)


async def generation(fe: Frontend, request: Request, req: NativeRequest, prompt: ChatPrompt,
                     endpoint: str) -> Generation:
    """The worker's Generation of a native request: its sampler chain, bias, grammar, slot and shift settings."""
    req.unsupported()
    names = req.sampler_names()
    slot = None if req.id_slot == -1 else req.id_slot
    parallel = fe.options.parallel
    if slot is not None and not 0 <= slot < parallel:
        raise ApiError(400, f"id_slot {slot}: this server has {parallel} slots (0 to {parallel - 1}, or -1 for any)",
                       param="id_slot")
    schema = (req.json_schema, True) if req.json_schema is not None else None
    plan = await fe.tool_plan([], "none", False, schema, req.grammar)
    bias = await fe.off_loop(logit_bias, fe, req.logit_bias, req.ignore_eos)
    tk = fe.engine.tokenizer
    n_keep = len(prompt.tokens) if req.n_keep == -1 else req.n_keep + int(tk.add_bos)
    g = fe.generation(prompt, req, None if req.n < 0 else req.n, stop=stops(req.stop), logit_bias=bias,
                      top_logprobs=req.n_probs or None, post_sampling=req.post_sampling_probs,
                      constraint=plan.constraint, endpoint=endpoint, session_key=session_key(request.headers),
                      slot=slot, cache_prompt=req.cache_prompt, n_keep=min(n_keep, len(prompt.tokens)),
                      n_discard=req.n_discard)
    p = g.params  # a sampler the chain leaves out does nothing (temperature 0 stays greedy)
    g.params = dataclasses.replace(
        p, top_k=p.top_k if "top_k" in names else 0, top_p=p.top_p if "top_p" in names else 1.0,
        min_p=p.min_p if "min_p" in names else 0.0,
        temperature=p.temperature if "temperature" in names or p.temperature == 0 else 1.0)
    return g


def logit_bias(fe: Frontend, value: list | dict | None, ignore_eos: bool) -> dict[int, float] | None:
    """llama-server's logit_bias: [token or text, bias] pairs, or {token or text: bias}; a text biases each of its
    tokens, and a bias of false bans the token. ignore_eos bans the end-of-generation tokens, as llama-server
    does (it never samples them)."""
    n = fe.engine.config.vocab_size
    pairs = value.items() if isinstance(value, dict) else value or []
    if len(pairs) > n:
        raise ApiError(400, f"logit_bias: {len(pairs):,} entries, more than the vocabulary of {n}", param="logit_bias")
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(value, dict) and not (isinstance(pair, list) and len(pair) == 2):
            raise ApiError(400, "logit_bias: each entry is a [token or text, bias] pair", param="logit_bias")
        key, bias = pair
        if bias is False:
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ApiError(400, f"logit_bias: the bias of {str(key)[:40]!r} is {bias!r}: a number, or false",
                           param="logit_bias")
        for token in _bias_tokens(fe, key, n):
            out[token] = float(bias)
    if ignore_eos:
        out.update({t: -math.inf for t in fe.engine.tokenizer.eog_ids})
    return out or None


def _bias_tokens(fe: Frontend, key: Any, n: int) -> list[int]:
    if isinstance(key, str) and key.isascii() and key.lstrip("-").isdigit() and len(key) <= 10:
        key = int(key)
    if _is_id(key):
        if not 0 <= key < n:
            raise ApiError(400, f"logit_bias: token {key} is outside the vocabulary of {n}", param="logit_bias")
        return [key]
    if isinstance(key, str) and len(key) <= 1024:
        return fe.engine.tokenizer.encode(key, add_bos=False, special=False)
    raise ApiError(400, "logit_bias: a key is a token id or a text (of at most 1,024 characters)",
                   param="logit_bias")


# --- answers ---


def probabilities(fe: Frontend, lps: list[TokenLogprob], post_sampling: bool) -> list[dict]:
    """completion_probabilities: each generated token with its probability (post_sampling: after the sampler's
    chain, as `prob`; else the model's, as `logprob`) and the most likely tokens'."""
    tk = fe.engine.tokenizer

    def entry(token: int, lp: float) -> dict:
        raw = tk.piece(token)
        value = {"prob": math.exp(lp)} if post_sampling else {"logprob": max(lp, LOWEST)}
        return {"id": token, "token": raw.decode("utf-8", errors="ignore"), "bytes": list(raw), **value}

    top = "top_probs" if post_sampling else "top_logprobs"
    return [{**entry(lp.token, lp.logprob), top: [entry(t, v) for t, v in lp.top]} for lp in lps]


def settings(fe: Frontend, g: Generation, req: NativeRequest) -> dict:
    """generation_settings: the request's parameters as this server ran them."""
    p = g.params
    return {"seed": p.seed if p.seed is not None else -1, "temperature": p.temperature, "top_k": p.top_k,
            "top_p": p.top_p, "min_p": p.min_p, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
            "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0,
            "repeat_last_n": 64, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
            "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "adaptive_target": -1.0, "adaptive_decay": 0.9,
            "stop": g.stop, "max_tokens": g.max_tokens, "n_predict": g.max_tokens, "n_keep": g.n_keep,
            "n_discard": g.n_discard, "ignore_eos": g.ignore_eos, "stream": req.stream,
            "logit_bias": [{"bias": None if math.isinf(b) else b, "token": t} for t, b in (g.logit_bias or {}).items()],
            "n_probs": req.n_probs, "min_keep": 0, "grammar": req.grammar or "", "samplers": list(req.sampler_names()),
            "timings_per_token": req.timings_per_token, "post_sampling_probs": req.post_sampling_probs,
            "speculative.types": "ngram" if fe.options.spec == "ngram" else "none", "lora": []}


def final(fe: Frontend, g: Generation, req: NativeRequest, done: Done, text: str, tokens: list[int],
          probs: list[TokenLogprob], index: int, *, streamed: bool) -> dict:
    """The answer of one prompt (streamed: its last chunk, whose text and tokens came before)."""
    c: ChoiceEnd = done.choices[0]
    stop_type = "word" if c.stop_sequence is not None else STOP_TYPES.get(c.finish_reason, "eos")
    # truncated: the context was shifted, or it ran out before the reply ended
    truncated = c.truncated or (c.finish_reason == "length"
                                and done.prompt_tokens + c.completion_tokens >= fe.worker.ctx - 1)
    out = {"index": index, "content": "" if streamed else text,
           "tokens": tokens if req.return_tokens and not streamed else [], "id_slot": done.slot, "stop": True,
           "model": fe.model_id, "tokens_predicted": c.completion_tokens, "tokens_evaluated": done.prompt_tokens,
           "generation_settings": settings(fe, g, req), "prompt": g.text, "has_new_line": "\n" in text,
           "truncated": truncated, "stop_type": stop_type, "stopping_word": c.stop_sequence or "",
           "tokens_cached": done.prompt_tokens + c.completion_tokens,
           "timings": timings(done, None, c.completion_tokens)}
    if probs and not streamed:
        out["completion_probabilities"] = probabilities(fe, probs, req.post_sampling_probs)
    return picked(out, req.response_fields) if req.response_fields else out


def picked(body: dict, paths: list[str]) -> dict:
    """response_fields: each path ("generation_settings/n_predict") that the answer has, as a key of its own."""
    out = {}
    for path in paths:
        value: Any = body
        for part in path.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            out[path] = value
    return out


async def answer(fe: Frontend, request: Request, req: NativeRequest, prompts: list[ChatPrompt], endpoint: str):
    """Each prompt's generation, streamed (one prompt) or answered whole: one object, or a list for several."""
    gens = [await generation(fe, request, req, p, endpoint) for p in prompts]
    if req.stream:
        if len(gens) > 1:
            raise ApiError(400, "stream: one prompt per streamed request", param="stream")
        return stream(fe.events(request, fe.job("generate", gens[0])), NativeStream(fe, gens[0], req))
    bodies = []
    for index, g in enumerate(gens):  # one after another: each reuses what the one before left
        outputs, done = await fe.answer(request, fe.job("generate", g))
        text = "".join(o.delta.text for o in outputs)
        tokens = [t for o in outputs for t in o.delta.tokens]
        probs = [lp for o in outputs for lp in o.delta.logprobs]
        bodies.append(final(fe, g, req, done, text, tokens, probs, index, streamed=False))
    return bodies[0] if len(bodies) == 1 else bodies


class NativeStream(StreamRenderer):
    """llama-server's stream: a chunk per piece of text (its tokens, their probabilities), progress chunks during
    the prefill when asked (return_progress), the final object with stop: true; no [DONE]."""

    def __init__(self, fe: Frontend, g: Generation, req: NativeRequest):
        self.fe, self.g, self.req = fe, g, req
        self.started_at = time.perf_counter()
        self.start: Started | None = None
        self.predicted = 0
        self.text: list[str] = []

    def keepalive(self) -> list[str]:
        return [": keepalive\n\n"]

    def started(self, e: Started) -> list[str]:
        self.start = e
        self.started_at = time.perf_counter()
        return self._progress(0)

    def progress(self, e: Progress) -> list[str]:
        return self._progress(e.prefilled)

    def _progress(self, prefilled: int) -> list[str]:
        if not self.req.return_progress:
            return []
        e = self.start
        seconds = time.perf_counter() - self.started_at if prefilled else 0.0
        return [sse_data({"index": 0, "content": "", "tokens": [], "stop": False, "id_slot": e.slot,
                          "tokens_predicted": 0, "tokens_evaluated": e.prompt_tokens,
                          "prompt_progress": prompt_progress(e, prefilled, seconds),
                          "timings": timings(None, e, 0, prompt_seconds=seconds, prefilled=prefilled)})]

    def output(self, e: Output) -> list[str]:
        d = e.delta
        self.predicted += len(d.tokens)
        self.text.append(d.text)
        start = self.start
        chunk = {"index": 0, "content": d.text, "tokens": d.tokens, "stop": False,
                 "id_slot": start.slot if start else -1, "tokens_predicted": self.predicted,
                 "tokens_evaluated": start.prompt_tokens if start else 0}
        if self.req.timings_per_token and start is not None:
            chunk["timings"] = timings(None, start, self.predicted)
        if d.logprobs:
            chunk["completion_probabilities"] = probabilities(self.fe, d.logprobs, self.req.post_sampling_probs)
        return [sse_data(chunk)]

    async def done(self, e: Done) -> list[str]:
        return [sse_data(final(self.fe, self.g, self.req, e, "".join(self.text), [], [], 0, streamed=True))]

    def failed(self, e: ApiError) -> list[str]:
        return [sse_data({"error": {"code": e.status, "message": e.message, "type": e.kind, **e.extra}})]
