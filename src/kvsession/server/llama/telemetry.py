"""llama-server's telemetry, which its native routes and its OpenAI-style ones carry alike: `timings` (what the
prompt reused and prefilled and how fast, what was generated and how fast) and `prompt_progress` (return_progress:
the prefill as it goes)."""
from __future__ import annotations

from ..events import Done, Started


def prompt_progress(start: Started, prefilled: int, seconds: float) -> dict:
    """llama-server's prompt_progress (its return_progress): the prompt's tokens, those reused, those in the KV
    so far, the milliseconds since the prefill began."""
    return {"total": start.prompt_tokens, "cache": start.cached_tokens, "processed": start.cached_tokens + prefilled,
            "time_ms": seconds * 1e3}



def timings(done: Done | None, started: Started | None, predicted: int, *, prompt_seconds: float | None = None,
            prefilled: int | None = None) -> dict:
    """llama-server's timings: the prompt's tokens reused (cache_n) and prefilled and how long that took, the tokens
    generated and how long after the prompt; a rate over the decode steps (the first token comes with the
    prompt's logits). During a prefill (a progress chunk) from what has been prefilled so far."""
    cached = done.cached_tokens if done is not None else started.cached_tokens if started is not None else 0
    prompt_n = done.prompt_tokens - done.cached_tokens if done is not None else prefilled or 0
    prompt_ms = (done.prompt_seconds if done is not None else prompt_seconds or 0.0) * 1e3
    predicted_ms = done.predicted_seconds * 1e3 if done is not None else 0.0
    steps = max(0, predicted - 1)
    return {"cache_n": cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1e3 / prompt_ms * prompt_n if prompt_ms > 0 else 0.0,
            "predicted_n": predicted, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
            "predicted_per_second": 1e3 / predicted_ms * steps if predicted_ms > 0 and steps else 0.0}
