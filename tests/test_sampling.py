"""Samplers: greedy, top-k / top-p / min-p semantics, seeded determinism, state round trip."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvsession.sampling import GREEDY, Sampler, SamplerParams, sample


def _rng(seed=0):
    return np.random.Generator(np.random.PCG64(seed))


def test_greedy_is_argmax_lowest_id_on_ties():
    logits = np.array([0.1, 3.0, 3.0, -1.0], dtype=np.float32)
    assert sample(logits, GREEDY, _rng()) == 1


def test_top_k_1_is_greedy_whatever_the_temperature():
    logits = np.random.default_rng(1).standard_normal(1000)
    p = SamplerParams(temperature=5.0, top_k=1, top_p=1.0, min_p=0.0)
    assert {sample(logits, p, _rng(s)) for s in range(20)} == {int(np.argmax(logits))}


def test_top_k_limits_the_candidates():
    logits = np.arange(100, dtype=np.float64)
    p = SamplerParams(temperature=100.0, top_k=3, top_p=1.0, min_p=0.0)
    assert {sample(logits, p, _rng(s)) for s in range(200)} == {97, 98, 99}


def test_top_p_keeps_the_smallest_covering_set():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    p = SamplerParams(temperature=1.0, top_k=0, top_p=0.75, min_p=0.0)
    got = {sample(np.log(probs), p, _rng(s)) for s in range(300)}
    assert got == {0, 1}


def test_min_p_drops_unlikely_tokens():
    probs = np.array([0.6, 0.3, 0.07, 0.03])
    p = SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1)
    got = {sample(np.log(probs), p, _rng(s)) for s in range(300)}
    assert got == {0, 1, 2}


def test_temperature_flattens():
    logits = np.array([2.0, 0.0])
    hot = SamplerParams(temperature=10.0, top_k=0, top_p=1.0, min_p=0.0)
    cold = SamplerParams(temperature=0.1, top_k=0, top_p=1.0, min_p=0.0)
    share = lambda p: np.mean([sample(logits, p, _rng(s)) for s in range(400)])  # noqa: E731
    assert share(cold) < 0.01 < 0.3 < share(hot)


def test_seeded_sampler_is_deterministic_and_state_round_trips():
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    params = SamplerParams(temperature=1.0, top_k=0, top_p=0.99, min_p=0.0, seed=42)
    a, b = Sampler(params), Sampler(params)
    seq_a = [a(logits) for _ in range(10)]
    assert seq_a == [b(logits) for _ in range(10)]
    state = json.loads(json.dumps(a.state()))  # the state survives JSON
    c = Sampler.from_state(state)
    assert [c(logits) for _ in range(10)] == [a(logits) for _ in range(10)]
    assert Sampler(SamplerParams(temperature=1.0, top_k=0, top_p=0.99, min_p=0.0, seed=43))(logits) is not None


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0), dict(top_p=1.5), dict(min_p=2),
                                 dict(top_k=1.5), dict(seed=-1), dict(seed=2.0), dict(temperature="hot")])
def test_bad_params_are_refused(bad):
    with pytest.raises(ValueError):
        SamplerParams(**bad)


@pytest.mark.parametrize("field, value, message", [
    ("temperature", float("nan"), "temperature must be a finite number >= 0, got nan"),
    ("temperature", float("inf"), "temperature must be a finite number >= 0, got inf"),
    ("top_p", float("nan"), "top_p must be in (0, 1], got nan"),
    ("top_p", float("inf"), "top_p must be in (0, 1], got inf"),
    ("min_p", float("nan"), "min_p must be in [0, 1], got nan"),
    ("min_p", float("-inf"), "min_p must be in [0, 1], got -inf"),
])
def test_non_finite_params_are_refused(field, value, message):
    with pytest.raises(ValueError) as e:
        SamplerParams(**{field: value})
    assert str(e.value) == message
