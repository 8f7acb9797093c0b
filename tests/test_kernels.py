"""The CPU kernels (kernels/__init__.py, csrc/) against the references they replace, under every build the CPU runs.

Block dequantization must give bit for bit what gguf.quants (llama.cpp's own
Python dequantizers) gives, for every type the packaged models use and the
neighbours of those types; products must equal their float64 references to
float32 rounding, on shapes with ragged edges. Attention has its own file,
test_flash.py.
"""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from kvsession import kernels
from kvsession.kernels import BlockLinear, BlockLinears, Scratch

Q = gguf.GGMLQuantizationType

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS,
         Q.MXFP4, Q.F16, Q.BF16, Q.F32]

# where each type keeps its f16 scale fields (byte offsets): random bytes there could be NaN or huge
SCALES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q2_K: (80, 82),
          Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.MXFP4: ()}

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())


@pytest.fixture(autouse=True, params=kernels.isas() or ["none"])
def isa(request):
    """Every test here runs under each build of the kernels this CPU runs (on a Zen 4 host: avx512bf16, avx512,
    avx2 and generic), so that no build goes untested for want of its CPU."""
    before = kernels.isa()
    kernels.use_isa(request.param)
    yield request.param
    kernels.use_isa(before)


@pytest.fixture(autouse=True)
def int8_prefill(monkeypatch):
    """The int8 GEMM is tested wherever a build has it, on a CPU with AMX too (where prompts take the bfloat16 one)."""
    monkeypatch.setattr(kernels, "INT8_PREFILL", True)


def random_tensor(qtype: Q, rows: int, cols: int, rng) -> np.ndarray:
    """[rows, row_bytes] uint8: random bytes that form valid blocks (finite, modest scales)."""
    if qtype in (Q.F32, Q.F16):
        m = rng.standard_normal((rows, cols)).astype(np.float32 if qtype == Q.F32 else np.float16)
        return m.view(np.uint8)
    if qtype == Q.BF16:
        m = torch.randn(rows, cols).to(torch.bfloat16).view(torch.int16).numpy()
        return m.view(np.uint8)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for at in SCALES[qtype]:
        raw[:, at : at + 2] = rng.uniform(0.001, 0.05, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    if qtype == Q.MXFP4:  # the power-of-two scale byte, 2^(e - 128): 2^-64 .. 2^-1 (e < 2 is subnormal, whose
        raw[:, 0] = rng.integers(64, 128, size=raw.shape[0])  # bfloat16 rounding no kernel promises)
    return raw.reshape(rows, -1)


def reference(data: np.ndarray, qtype: Q, cols: int) -> np.ndarray:
    if qtype == Q.F32:
        return data.view(np.float32)
    if qtype == Q.F16:
        return data.view(np.float16).astype(np.float32)
    return np.asarray(gguf.quants.dequantize(data, qtype), np.float32).reshape(data.shape[0], cols)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantized_rows_are_ggmls_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 37, 512
    data = random_tensor(qtype, rows, cols, rng)
    lin = BlockLinear(data, qtype, cols, None, Scratch())
    want = reference(data, qtype, cols)
    ids = np.array([0, 36, 5, 5, 17])
    assert np.array_equal(lin.rows(ids), want[ids])
    # the bfloat16 slabs prefill multiplies: torch's own rounding of the same values
    w = lin.dequant_into(torch.empty(20, cols, dtype=torch.bfloat16), 3)
    assert torch.equal(w, torch.from_numpy(want[3:23]).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("T", [1, 3, 5, 40, 45, 160])
def test_products_equal_float64(qtype, T):
    rng = np.random.default_rng(100 + int(qtype))
    rows, cols = 83, 768  # rows: not a multiple of the 16-row slices the threads split
    data = random_tensor(qtype, rows, cols, rng)
    bias = torch.randn(rows)
    lin = BlockLinear(data, qtype, cols, bias, Scratch())
    x = torch.randn(T, cols)
    want = x.double() @ torch.from_numpy(reference(data, qtype, cols)).double().T + bias.double()
    got = lin(x)
    assert got.shape == (T, rows) and got.dtype == torch.float32
    scale = want.abs().max().item()
    # many tokens: bfloat16 activations and slabs (prefill), or the int8 GEMM
    tol = 2e-2
    rounds = lin.rounds if T <= lin.kernel_tokens else 32 if lin.int8_gemm else 0
    if T <= lin.kernel_tokens or rounds:
        tol = 1e-5  # a few (or on AVX2, up to TILED_TOKENS): float32 products of float32 activations, or of
        # activations rounded as llama.cpp does; the int8 GEMM rounds them with one scale a 32 values
        if rounds:  # in float32 as the kernels round: x * (127 / amax), half to even
            xb = x.view(T, -1, rounds)
            amax = xb.abs().amax(-1, keepdim=True)
            id_ = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)  # (127 / t is 127 * (1 / t))
            q = (xb * id_).round()
            x8 = (q.double() * (amax / 127).double()).view(T, cols)
            want = x8 @ torch.from_numpy(reference(data, qtype, cols)).double().T + bias.double()
    assert (got.double() - want).abs().max().item() <= tol * scale


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_tokens_product_does_not_depend_on_its_neighbours(qtype):
    # the int8 products unpack a block once for several tokens; each token's sums are its own, in one order
    rng = np.random.default_rng(7 + int(qtype))
    lin = BlockLinear(random_tensor(qtype, 70, 512, rng), qtype, 512, None, Scratch())
    if not lin.rounds:
        pytest.skip("no int8 product for this type in this build")
    T = min(lin.kernel_tokens, 11)
    x = torch.randn(T, 512)
    y = lin(x)
    for t in range(T):
        assert torch.equal(y[t], lin(x[t : t + 1])[0])
    if lin.int8_gemm:  # the GEMM's tiles of tokens, cut elsewhere
        x = torch.randn(40, 512)
        assert torch.equal(lin(x)[13:36], lin(x[13:36]))


def test_the_int8_gemm_takes_no_tokens_and_refuses_bad_shapes():
    lin = BlockLinear(random_tensor(Q.Q4_K, 32, 256, np.random.default_rng(9)), Q.Q4_K, 256, None, Scratch())
    if not lin.int8_gemm:
        pytest.skip("no int8 GEMM in this build")
    y = torch.empty(0, 32)
    lin.gemm_into(torch.empty(0, 256), y)  # nothing to do, and no error
    x = torch.randn(3, 256)
    with pytest.raises(ValueError, match="bad shape"):  # rows wider than the output's
        kernels._kernels.gemm(Q.Q4_K, lin.address, 32, 256, x.data_ptr(), 256, 3, y.data_ptr(), 16, 1)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("fill", [0x00, 0x7F, 0x80, 0xFF])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_int8_gemm_sums_do_not_saturate(qtype, fill, sign):
    # every code at an extreme and every activation rounded to +-127: the largest integer sums there are (the AVX2
    # build adds vpmaddubsw's s16 pair sums as far as the codes' bits allow before widening them)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.full((32 * 512 // block, size), fill, np.uint8)
    for at in SCALES[qtype]:
        blocks[:, at : at + 2] = np.array([0.01], np.float16).view(np.uint8)
    lin = BlockLinear(blocks.reshape(32, -1), qtype, 512, None, Scratch())
    if not lin.int8_gemm:
        pytest.skip("no int8 GEMM in this build")
    x = torch.full((20, 512), sign)
    want = x.double() @ torch.from_numpy(reference(lin.data, qtype, 512)).double().T
    torch.testing.assert_close(lin(x).double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_a_fused_projection_is_its_parts_side_by_side():
    rng = np.random.default_rng(5)
    scratch = Scratch()
    parts = [BlockLinear(random_tensor(t, n, 256, rng), t, 256, b, scratch)
             for t, n, b in [(Q.Q5_0, 48, torch.randn(48)), (Q.Q6_K, 16, None), (Q.Q8_0, 16, torch.randn(16))]]
    fused = BlockLinears(parts)
    for T in (1, 5, 40, 300):  # a few tokens: part by part; more: one slab, one GEMM
        x = torch.randn(T, 256)
        if T <= min(p.kernel_tokens for p in parts) or all(p.int8_gemm for p in parts):
            torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=0, atol=1e-5)
        else:  # one slab and GEMM of the same weights (a part alone may round its activations to 8 bits)
            w = torch.cat([torch.from_numpy(reference(p.data, p.qtype, 256)) for p in parts]).double()
            want = x.double() @ w.T + fused.bias.double()
            tol = 1e-5 if scratch.dtype == torch.float32 else 2e-2  # a bfloat16 GEMM's output is bfloat16
            assert (fused(x).double() - want).abs().max().item() <= tol * want.abs().max().item()


def test_prefill_slabs_cover_every_row(monkeypatch):
    rng = np.random.default_rng(3)
    data = random_tensor(Q.Q8_0, 100, 64, rng)
    x = torch.randn(20, 64)
    for dtype in (torch.bfloat16, torch.float32):  # whichever this CPU multiplies (kernels.GEMM_DTYPE)
        monkeypatch.setattr(kernels, "SLAB_BYTES", 64 * 32 * dtype.itemsize)  # 32-row slabs (a multiple of 16)
        lin = BlockLinear(data, Q.Q8_0, 64, None, Scratch(dtype))
        assert lin.slab_rows == 32
        want = x.to(dtype).double() @ torch.from_numpy(reference(data, Q.Q8_0, 64)).to(dtype).double().T
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # a bfloat16 GEMM's output is bfloat16
        torch.testing.assert_close(lin._gemm(x.to(dtype)).double(), want, rtol=tol, atol=tol)


def test_the_gemm_is_bfloat16_only_where_the_cpu_multiplies_it(tmp_path):
    cpu = tmp_path / "cpuinfo"
    cpu.write_text("flags\t\t: fpu sse2 avx2 fma f16c\n")  # an AVX2-only CPU: bfloat16 would be converted
    assert kernels.gemm_dtype(cpu) == torch.float32
    cpu.write_text("flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16\n")
    assert kernels.gemm_dtype(cpu) == torch.bfloat16
    cpu.write_text("flags\t\t: fpu avx2 amx_bf16 amx_tile amx_int8\n")
    assert kernels.gemm_dtype(cpu) == torch.bfloat16
    assert kernels.gemm_dtype(tmp_path / "absent") == torch.float32
    assert not kernels.int8_prefill(cpu)  # AMX: PyTorch's bfloat16 GEMM on the tiles, not the int8 one
    cpu.write_text("flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16\n")
    assert kernels.int8_prefill(cpu)
    assert Scratch().dtype == kernels.GEMM_DTYPE


def test_products_are_deterministic_and_thread_independent():
    rng = np.random.default_rng(4)
    data = random_tensor(Q.Q4_K, 300, 1024, rng)
    lin = BlockLinear(data, Q.Q4_K, 1024, None, Scratch())
    x = torch.randn(1, 1024)
    threads = torch.get_num_threads()
    try:
        one = lin(x)
        torch.set_num_threads(1)
        alone = lin(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, alone)  # each output row is summed by one thread, in one order


def test_a_bad_shape_is_refused():
    data = np.zeros((4, 34), np.uint8)
    with pytest.raises(ValueError, match="not 64 values a row"):
        BlockLinear(data, Q.Q8_0, 64, None, Scratch())  # 34 bytes hold 32 values
    assert not kernels.supports(Q.IQ2_XXS)


# --- the layer stack (kernels.Stack) against the per-layer PyTorch path ---------------------------------------

from tiny import TINY_TEXT, TinySpec  # noqa: E402

from kvsession.engine import Engine  # noqa: E402
from kvsession.errors import ContextFull  # noqa: E402
from kvsession.session import advance  # noqa: E402

# layers of float kernels (the per-layer path multiplies exactly as the stack does; the tied Q8_0 head rounds
# its input to 8 bits, where a last-bit difference can move a rounding), and a model of int8 kernels
STACK_SPECS = {
    "llama": (TinySpec(weight_type="Q5_1", seed=11), 1e-2),
    "qwen2-bias": (TinySpec(arch="qwen2", weight_type="Q5_1", seed=12), 1e-2),
    "gemma3-rings": (TinySpec(arch="gemma3", weight_type="F16", n_layers=4, sliding_window=8, swa_pattern=2,
                              seed=13), 1e-2),
    "gemma3-int8": (TinySpec(arch="gemma3", weight_type="Q8_0", n_layers=4, sliding_window=8, swa_pattern=2,
                             seed=13), 3e-2),
    "qwen3-qk-norm": (TinySpec(arch="qwen3", weight_type="Q5_1", n_heads=4, head_dim=32, seed=14), 1e-2),
    "llama3-rope-freqs": (TinySpec(weight_type="Q4_1", rope_freqs=True, rope_base=5e5, seed=15), 1e-2),
    "smollm3-no-rope-layers": (TinySpec(arch="smollm3", weight_type="Q5_1", n_layers=4, seed=16), 1e-2),
    "granite-multipliers": (TinySpec(arch="granite", weight_type="Q5_1", seed=17), 1e-2),
    "gemma2-softcap-rings": (TinySpec(arch="gemma2", weight_type="F16", n_layers=4, sliding_window=8, seed=18), 1e-2),
    "phi3-fused-partial-rope": (TinySpec(arch="phi3", weight_type="Q5_1", rope_dim=8, seed=19), 1e-2),
}


def _decode(engine: Engine, ids: list[int], prompt: int, stacked: bool) -> torch.Tensor:
    """logits of each token after the first `prompt`, fed one at a time, with or without the stack"""
    stack = engine.model.stack
    engine.model.stack = stack if stacked else None
    try:
        s = engine.session(max_tokens=64)  # a full cache grows while decoding: the stack must claim first
        s.prefill(ids[:prompt])
        out = []
        for t in ids[prompt:]:
            s.append(t)
            out.append(s.logits.clone())
        return torch.stack(out)
    finally:
        engine.model.stack = stack


@pytest.mark.parametrize("name", list(STACK_SPECS))
def test_the_stack_decodes_what_the_layers_decode(tiny_factory, name):
    spec, tol = STACK_SPECS[name]
    engine = Engine.load(tiny_factory(spec), device="cpu", precision="bf16")
    assert engine.model.stack is not None
    ids = (engine.tokenizer.encode(TINY_TEXT) * 4)[:40]  # past gemma's window of 8: the rings wrap
    fast, slow = _decode(engine, ids, 12, True), _decode(engine, ids, 12, False)
    scale = slow.abs().max().item()
    assert (fast - slow).abs().max().item() <= tol * scale
    assert (fast.argmax(-1) == slow.argmax(-1)).float().mean().item() >= (1.0 if tol <= 1e-2 else 0.9)


def test_the_stack_decodes_deep_in_the_context_with_its_memory_taken_first(tiny_factory):
    """Past several of flash-decoding's key pieces (256 keys each) the stack's attention merges partials in the
    scratch the run takes before it writes anything: the same logits as the layers', and two sequences at
    different depths in one run get what each gets alone."""
    spec = dataclasses.replace(STACK_SPECS["llama"][0], context=1024)
    engine = Engine.load(tiny_factory(spec), device="cpu", precision="bf16")
    ids = (engine.tokenizer.encode(TINY_TEXT) * 64)[:700]

    def deep(prompt: int, stacked: bool) -> torch.Tensor:
        stack = engine.model.stack
        engine.model.stack = stack if stacked else None
        try:
            s = engine.session(max_tokens=720)
            s.prefill(ids[:prompt])
            out = []
            for t in ids[prompt:prompt + 4]:
                s.append(t)
                out.append(s.logits.clone())
            return torch.stack(out)
        finally:
            engine.model.stack = stack

    fast, slow = deep(640, True), deep(640, False)
    assert (fast - slow).abs().max().item() <= 1e-2 * slow.abs().max().item()
    assert torch.equal(fast.argmax(-1), slow.argmax(-1))
    a, b = engine.session(max_tokens=720), engine.session(max_tokens=720)
    a.prefill(ids[:600])
    b.prefill(ids[:300])
    alone = [engine.session(max_tokens=720) for _ in range(2)]
    alone[0].prefill(ids[:600])
    alone[1].prefill(ids[:300])
    advance([(a, [ids[600]]), (b, [ids[300]])])
    alone[0].append(ids[600])
    alone[1].append(ids[300])
    assert torch.equal(a.logits, alone[0].logits) and torch.equal(b.logits, alone[1].logits)


def test_the_stack_runs_a_few_tokens_at_once_and_checks_bounds(tiny_factory):
    engine = Engine.load(tiny_factory(STACK_SPECS["llama"][0]), device="cpu", precision="bf16")
    ids = engine.tokenizer.encode(TINY_TEXT)[:20]
    one = engine.session()
    one.prefill(ids[:12])
    for t in ids[12:]:
        one.append(t)
    batch = engine.session()
    batch.prefill(ids[:12])
    batch.prefill(ids[12:], chunk_size=kernels.KERNEL_TOKENS)  # 8 tokens in one call of the stack
    torch.testing.assert_close(batch.logits, one.logits, rtol=1e-4, atol=1e-4)
    # the model asked for a row past the context (the session refuses before it would): in gemma3 the first
    # layer is a ring, which takes any new row, the second a full layer at its end; the stack's claim refuses,
    # and no layer keeps a claimed row
    gemma = Engine.load(tiny_factory(STACK_SPECS["gemma3-rings"][0]), device="cpu", precision="bf16")
    assert gemma.model.stack is not None and gemma.config.layers[0].kind == "sliding"
    ids = gemma.tokenizer.encode(TINY_TEXT)[:20]
    full = gemma.session(max_tokens=len(ids))
    full.prefill(ids)
    ref = gemma.session(max_tokens=len(ids))
    ref.prefill(ids[:-1])
    ref.append(ids[-1])
    with pytest.raises(ContextFull):
        gemma.model.forward(ids[:1], range(len(ids), len(ids) + 1), full.cache)
    assert [c.end for c in full.cache] == [len(ids)] * len(full.cache)
    full.truncate(len(ids) - 1)
    full.append(ids[-1])  # still a sound cache: it continues as one that never saw the refusal
    torch.testing.assert_close(full.logits, ref.logits, rtol=1e-5, atol=1e-5)


def test_gelu_mul_is_ggmls_table_gelu_times_up():
    from kvsession.model.transformer import gelu_tanh

    every_f16 = (torch.arange(65536, dtype=torch.int32) - 32768).to(torch.int16).view(torch.float16).float()
    finite = every_f16[every_f16.isfinite()]  # 63,488
    rng = torch.Generator().manual_seed(0)
    g = torch.cat([finite, torch.tensor([-10.0, -10.5, -1e30, 10.0, 10.25, 1e30, 3.0001]),
                   torch.randn(10005, generator=rng) * 6])
    u = torch.randn(g.numel(), generator=rng)
    T = 7  # rows of the fused [T, 2 * d_ff] gate-and-up output
    assert g.numel() % T == 0
    g, u = g.view(T, -1), u.view(T, -1)
    got = kernels.gelu_mul(torch.cat([g, u], dim=1))
    assert got.shape == g.shape
    # past +-10 exact: 0, and the input itself
    assert torch.equal(got[g <= -10], torch.zeros_like(got[g <= -10]))
    assert torch.equal(got[g >= 10], (g * u)[g >= 10])
    # elsewhere the table of ggml_gelu_f32 (libm's tanhf); PyTorch's tanh emulation differs by a float16 last bit
    # on a few dozen of the 63,488 finite inputs
    want = gelu_tanh(g) * u
    differ = got != want
    assert differ.flatten()[: finite.numel()].sum().item() < 60
    assert ((got - want).abs()[differ] <= 2 ** -10 * want.abs()[differ] + 1e-6).all()
    assert torch.isnan(kernels.gelu_mul(torch.tensor([[float("nan"), 1.0]])))[0, 0]


def test_large_freed_buffers_stay_for_reuse_on_glibc():
    import platform

    kept = kernels.keep_freed_buffers()  # what the CPU engine does at load: idempotent
    assert kept == (platform.libc_ver()[0] == "glibc")
