"""Flash attention (kernels.attend, csrc/attend.h) against float64 attention, under every build the CPU runs.

Every layer kind and feature the models use: full layers and rings whose window crosses the kernel's key tiles,
Gemma 2's soft-cap, gpt-oss's sinks, 1 to 8 query heads a KV head, heads of 64, 128 and 256 numbers (and 80,
whose last 16 fill half a bfloat16 register), one query (decode, its keys cut among threads) and many (a
prompt's chunk, in tiles of queries), at positions and chunk sizes that fall across tiles.

The inputs are rounded to bfloat16 first, so that a build that multiplies in bfloat16 (avx512bf16 with a float16,
bfloat16 or q8_0 cache) sees exactly the numbers the reference does: what is left of its error is the
probabilities' rounding to bfloat16, well under the weight of a single wrong key. A q8_0 cache (uint8: llama.cpp's
blocks of 32 int8 and an f16 scale) is made of int8 and power-of-two scales, whose products bfloat16 holds
exactly; the reference reads the numbers the blocks stand for. Where K.Q is an int8 product (both AVX-512 builds,
a q8_0 cache), the reference is given the queries as the kernel quantizes them, and what is left is float32's
(avx512) or P.V's bfloat16 rounding (avx512bf16).
"""
from __future__ import annotations

import pytest
import torch

from kvsession import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())

# max |got - want| / max |v|, by kernels.attend_products: in bfloat16 (probabilities rounded to 8 bits), K.Q in int8
# (the reference given the queries as the kernel quantizes them) with P.V in bfloat16 or float32, or all in float32
TOL = {"bfloat16": 2e-3, "int8-bf16": 2e-3, "int8": 2e-6, "float32": 2e-6}


@pytest.fixture(autouse=True, params=kernels.isas() or ["none"])
def isa(request):
    """Each test under every build this CPU runs (a Zen 4: avx512bf16, avx512, avx2, generic)."""
    before = kernels.isa()
    kernels.use_isa(request.param)
    yield request.param
    kernels.use_isa(before)


def reference(q, k, v, ring, pos0, key_lo, window, scale, softcap=0.0, sinks=None):
    """float64 attention of queries pos0.. over the cache rows each may see: [T, H * D]."""
    T, H, D = q.shape
    cap, Hk = k.shape[0], k.shape[1]
    first = max(key_lo, pos0 - window + 1) if window else key_lo
    pos = torch.arange(first, pos0 + T)  # every key some query sees, in order
    rows = pos % cap if ring else pos
    kk = k[rows].double().repeat_interleave(H // Hk, dim=1).transpose(0, 1)  # [H, S, D]
    vv = v[rows].double().repeat_interleave(H // Hk, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ kk.transpose(1, 2) * scale  # [H, T, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    qp = torch.arange(pos0, pos0 + T)[:, None]
    seen = (pos[None, :] <= qp) & (pos[None, :] >= key_lo)
    if window:
        seen &= pos[None, :] > qp - window
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.double().view(H, 1, 1).expand(H, T, 1)), dim=-1)
        w = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        w = torch.softmax(scores, dim=-1)
    return (w @ vv).transpose(0, 1).reshape(T, H * D)


def bf16_exact(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).to(torch.bfloat16).float()


def q8_0_rows(*shape):
    """Rows [..., D] of q8_0 blocks, uint8 [..., D / 32 * 34], and the float32 numbers they stand for: int8 in
    [-127, 127] times a power-of-two scale a block (exact in float16 and, their products, in bfloat16)."""
    *lead, D = shape
    q = torch.randint(-127, 128, (*lead, D // 32, 32), dtype=torch.int8)
    d = (2.0 ** torch.randint(-9, -5, (*lead, D // 32, 1))).half()
    blocks = torch.cat((d.view(torch.uint8), q.view(torch.uint8)), dim=-1)  # [..., blocks, 34]
    return blocks.reshape(*lead, D // 32 * 34), (q.float() * d.float()).reshape(*lead, D)


def quantized_queries(q):
    """q [..., D] as the int8 kernel multiplies it: blocks of 32, each int8 (round half to even) times the block's
    largest magnitude / 127, all in float32 (llama.cpp's quantize_row_q8_0, the scale kept in float32)."""
    b = q.reshape(*q.shape[:-1], -1, 32)
    amax = b.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)  # a division (127.0 / amax: a reciprocal's product)
    return (torch.round(b * inv) * (amax / 127.0)).reshape(q.shape)


def cache_rows(dtype, *shape):
    """(what the cache holds, the numbers it stands for as float32) of a cache of `dtype` (uint8: q8_0)."""
    if dtype == torch.uint8:
        return q8_0_rows(*shape)
    x = bf16_exact(*shape)
    return x.to(dtype), x.to(dtype).float()


def check(dtype, H, Hk, D, T, pos0, *, ring=False, window=0, key_lo=0, cap=None, softcap=0.0, sinks=False,
          qscale=1.0, seed=0):
    torch.manual_seed(seed)
    cap = cap or pos0 + T
    k, kf = cache_rows(dtype, cap, Hk, D)
    v, vf = cache_rows(dtype, cap, Hk, D)
    q = bf16_exact(T, H, D, scale=qscale)
    s = bf16_exact(H, scale=3.0) if sinks else None
    scale = D ** -0.5 if D in (64, 256) else 0.125  # a power of two: the scaled queries stay exact
    got = kernels.attend(k, v, ring, q, pos0, key_lo, window, scale, softcap, s)
    products = kernels.attend_products(dtype)
    want = reference(quantized_queries(q) if products.startswith("int8") else q, kf, vf, ring, pos0, key_lo, window,
                     scale, softcap, s)
    assert got.shape == (T, H * D) and torch.isfinite(got).all()
    tol = TOL[products]
    err = (got.double() - want).abs().max().item() / vf.double().abs().max().item()
    assert err < tol, f"error {err:.2e} of max |v|, tolerance {tol:.0e}"
    return got


DTYPES, DTYPE_IDS = [torch.float16, torch.bfloat16, torch.uint8], ["f16", "bf16", "q8_0"]  # uint8: q8_0


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("G", range(1, 9))
@pytest.mark.parametrize("T,pos0", [(1, 0), (1, 77), (1, 1000), (3, 997), (37, 0), (300, 13), (45, 700)])
def test_full_layers_equal_float64(dtype, G, T, pos0):
    """Full layers, every GQA ratio: one query whose keys are cut into pieces (pos0 1000), a few, chunks of
    queries that start at 0 and elsewhere and end off the tiles' edges."""
    check(dtype, 2 * G, 2, 64, T, pos0, seed=G + T)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("D", [64, 128, 256, 80, 96])
@pytest.mark.parametrize("T,pos0", [(1, 530), (70, 200)])
def test_every_head_size_equals_float64(dtype, D, T, pos0):
    if dtype == torch.uint8 and D % 32:
        pytest.skip("q8_0 blocks are 32 numbers: heads of 80 take f16 or bf16")
    check(dtype, 8, 2, D, T, pos0, seed=D)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T,pos0,window,cap,key_lo", [
    (1, 5000, 100, 612, 4488),  # a wrapped ring, decode: the window crosses two key tiles
    (3, 5000, 100, 612, 4488),
    (130, 4870, 100, 612, 4488),  # a prompt's chunk in a wrapped ring: each query's own window
    (50, 20, 100, 612, 0),  # a ring not yet full
    (200, 9, 64, 576, 0),  # windows exactly a tile wide, not aligned to the tiles
    (1, 300, 512, 1024, 290),  # a loaded ring: nothing stored before key_lo
    (1, 3000, 700, 1024, 0),  # a wrapped ring, decode: a window of 700 keys cut into pieces among threads
    (5, 3000, 700, 1024, 0),  # a few queries, each its own window, the same pieces
])
def test_rings_equal_float64(dtype, T, pos0, window, cap, key_lo):
    check(dtype, 8, 2, 64, T, pos0, ring=True, window=window, cap=cap, key_lo=key_lo, seed=T + window)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T,pos0,ring", [(1, 700, False), (40, 90, False), (1, 700, True), (60, 650, True)])
def test_soft_cap_equals_float64(dtype, T, pos0, ring):
    """Gemma 2's soft-cap, with scores well past the cap (the queries scaled up)."""
    window, cap = (128, 640) if ring else (0, None)
    got = check(dtype, 8, 4, 256, T, pos0, ring=ring, window=window, cap=cap, softcap=2.0, qscale=4.0, seed=T)
    torch.manual_seed(T)
    cap = cap or pos0 + T
    (_, k), (_, v) = cache_rows(dtype, cap, 4, 256), cache_rows(dtype, cap, 4, 256)
    q = bf16_exact(T, 8, 256, scale=4.0)
    uncapped = reference(q, k, v, ring, pos0, 0, window, 256 ** -0.5)
    assert (got.double() - uncapped).abs().max() > 0.1  # the cap changed the answer


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T,pos0,ring", [(1, 0, False), (1, 900, False), (33, 100, False), (20, 500, True)])
def test_sinks_equal_float64(dtype, T, pos0, ring):
    """gpt-oss's sinks: a logit a head, from nothing to most of the softmax, alone at position 0 and among many
    keys (decode's pieces merged with it), in full layers and rings."""
    window, cap = (128, 640) if ring else (0, None)
    check(dtype, 8, 1, 64, T, pos0, ring=ring, window=window, cap=cap, sinks=True, seed=T + pos0)


@pytest.mark.parametrize("T,pos0", [(1, 600), (100, 50)])
def test_float32_caches_multiply_in_float32(T, pos0):
    assert kernels.attend_products(torch.float32) == "float32"
    check(torch.float32, 6, 2, 128, T, pos0)
    check(torch.float32, 6, 2, 64, T, pos0, softcap=1.5, qscale=4.0, sinks=True)


@pytest.mark.parametrize("T,pos0", [(1, 3000), (6, 3000), (300, 700)])
def test_the_same_cache_gives_the_same_bits_on_any_number_of_threads(T, pos0):
    torch.manual_seed(1)
    k, v = torch.randn(pos0 + T, 2, 64).half(), torch.randn(pos0 + T, 2, 64).half()
    q = torch.randn(T, 14, 64)
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(kernels.attend(k, v, False, q, pos0, 0, 0, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_a_prompt_in_chunks_attends_as_it_does_whole():
    """Queries cut into chunks (a session's prefill), each chunk over the rows stored so far, against the whole
    prompt at once: the same attention to the kernels' rounding."""
    torch.manual_seed(2)
    T, H, Hk, D = 700, 6, 2, 64
    k, v = torch.randn(T, Hk, D).half(), torch.randn(T, Hk, D).half()
    q = torch.randn(T, H, D)
    whole = kernels.attend(k, v, False, q, 0, 0, 0, 0.125)
    parts = torch.cat([kernels.attend(k, v, False, q[a : a + 256], a, 0, 0, 0.125) for a in range(0, T, 256)])
    tol = TOL[kernels.attend_products(torch.float16)]
    assert (parts - whole).abs().max().item() < tol * v.float().abs().max().item()


@pytest.mark.parametrize("T,pos0", [(5, 97), (1, 0), (40, 0)])
def test_pytorch_attention_off_the_cpu_kernels_equals_float64(T, pos0):
    """model/transformer.attention, what a GPU (or a head size the kernels refuse) runs: the same soft-cap and
    sinks, keys as a cache hands them out ([Hk, S, D] float32 from position 0)."""
    from kvsession.model.transformer import attention

    torch.manual_seed(7)
    H, Hk, D, S = 6, 2, 64, pos0 + T
    k, v, q = torch.randn(S, Hk, D), torch.randn(S, Hk, D), torch.randn(T, H, D) * 4
    sinks = torch.tensor([-3.0, 0.0, 1.0, 2.5, 6.0, -30.0])  # from nothing to most of the softmax
    for softcap, s in [(0.0, None), (1.5, None), (0.0, sinks), (1.5, sinks)]:
        want = reference(q, k, v, False, pos0, 0, 0, 0.125, softcap, s)
        out = attention(q, k.transpose(0, 1), v.transpose(0, 1), range(pos0, S), 0, 0, 0.125, softcap, s)
        assert (out.double() - want).abs().max().item() < 1e-5


def test_pytorch_attention_in_chunks_of_queries_is_all_of_them_at_once(monkeypatch):
    from kvsession.model import transformer

    torch.manual_seed(9)
    T, S, H, Hk, D = 37, 60, 6, 2, 64
    q, k, v = torch.randn(T, H, D), torch.randn(Hk, S, D), torch.randn(Hk, S, D)
    sinks = torch.randn(H)
    for positions, key_first, window in [(range(23, 60), 0, 0), (range(0, 37), 0, 8), (range(0, 37), 0, 0)]:
        keys, values = k[:, : positions.stop - key_first], v[:, : positions.stop - key_first]
        whole = transformer.attention(q, keys, values, positions, key_first, window, 0.125, 1.5, sinks)
        monkeypatch.setattr(transformer, "SCORES_AT_ONCE", H * S * 5)  # 5 queries a chunk: 8 chunks, the last of 2
        chunked = transformer.attention(q, keys, values, positions, key_first, window, 0.125, 1.5, sinks)
        monkeypatch.undo()
        torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


def test_attention_refuses_what_it_cannot_do():
    k = torch.zeros(8, 2, 64, dtype=torch.float16)
    q = torch.zeros(1, 5, 64)  # 5 heads do not share 2 KV heads evenly
    with pytest.raises(ValueError, match="attend"):
        kernels.attend(k, k, False, q, 3, 0, 0, 1.0)
    with pytest.raises(ValueError, match="sinks"):
        kernels.attend(k, k, False, torch.zeros(1, 4, 64), 3, 0, 0, 1.0, sinks=torch.zeros(3))
    assert not kernels.attends(torch.float16, 72)  # head sizes are whole 16-float registers
    assert not kernels.attends(torch.uint8, 80) and kernels.attends(torch.uint8, 96)  # q8_0: whole blocks of 32
    assert kernels.attends(torch.float16, 256) and not kernels.attends(torch.float16, 512)  # csrc/kernels.h MAX_HEAD_DIM
