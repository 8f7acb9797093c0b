"""GGUF loading: config, dequantization, fingerprints, and every error."""
from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
from tiny import TinySpec, write_tiny

from kvsession.errors import (
    CorruptModelFile,
    MissingTensor,
    ModelNotFound,
    NotGGUF,
    UnsupportedArchitecture,
    UnsupportedTensorType,
)
from kvsession.model import fingerprint
from kvsession.model import gguf as gguf_reader
from kvsession.model.gguf import GGUFFile, dequantize, supported_tensor_types

Q = gguf.GGMLQuantizationType


def test_config_from_metadata(tiny_factory):
    f = GGUFFile(tiny_factory(TinySpec(n_layers=3, n_heads=4, n_kv_heads=1, d_ff=96, tied=False)))
    c = f.config
    assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == ("llama", 3, 64, 4, 1, 16, 96)
    assert c.vocab_size == 288 and c.context_length == 512
    assert c.tied_embeddings is False and c.attn_bias is False
    assert all(s.kind == "full" and s.rope.kind == "norm" and s.rope.dim == 16 for s in c.layers)


def test_qwen2_has_biases_and_neox_rope(tiny_factory):
    c = GGUFFile(tiny_factory(TinySpec(arch="qwen2"))).config
    assert c.attn_bias is True
    assert c.layers[0].rope.kind == "neox"


def test_required_types_are_supported():
    have = supported_tensor_types()
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"):
        assert Q[name] in have, name


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_dequantize_round_trips_each_type(tmp_path, qtype):
    rng = np.random.default_rng(1)
    m = rng.standard_normal((16, 64)).astype(np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    t = Q[qtype]
    if t == Q.F32:
        w.add_tensor("x", m)
    elif t == Q.F16:
        w.add_tensor("x", m.astype(np.float16))
    else:
        w.add_tensor("x", gguf.quants.quantize(m, t), raw_shape=gguf.quant_shape_to_byte_shape(m.shape, t), raw_dtype=t)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    tensor = gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors[0]
    got = dequantize(tensor)
    assert got.shape == (16, 64) and got.dtype == np.float32
    # one quantization step of each format, relative to the largest value
    step = {"F32": 0, "F16": 2**-10, "BF16": 2**-7, "Q8_0": 1 / 127, "Q5_0": 1 / 16, "Q5_1": 2 / 31,
            "Q4_0": 1 / 8, "Q4_1": 2 / 15}[qtype]
    assert np.abs(got - m).max() <= step * np.abs(m).max()
    assert np.abs(got - m).max() > 0 or qtype == "F32"


def test_fingerprint_is_stable_cached_and_weight_sensitive(tiny_factory, monkeypatch):
    a = GGUFFile(tiny_factory(TinySpec(seed=0)))
    b = GGUFFile(tiny_factory(TinySpec(seed=0)))
    c = GGUFFile(tiny_factory(TinySpec(seed=9)))
    assert a.fingerprint.digest == b.fingerprint.digest
    assert a.fingerprint.kv_shape == c.fingerprint.kv_shape
    assert a.fingerprint.weights != c.fingerprint.weights
    assert a.fingerprint.digest != c.fingerprint.digest
    # second opening of the same file takes the digest from the cache, without hashing
    fingerprint._digests.clear()
    monkeypatch.setattr(GGUFFile, "weights_digest", lambda self: pytest.fail("hashed again"))
    assert GGUFFile(a.path).fingerprint.digest == a.fingerprint.digest


def test_fingerprint_cache_notices_a_changed_file(tmp_path):
    p = write_tiny(tmp_path / "m.gguf", TinySpec(seed=0))
    first = GGUFFile(p).fingerprint.weights
    write_tiny(p, TinySpec(seed=3))  # same path, other weights
    assert GGUFFile(p).fingerprint.weights != first


# --- errors ------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFound, match="no such file"):
        GGUFFile(tmp_path / "nope.gguf")


def test_folder(tmp_path):
    with pytest.raises(NotGGUF, match="folder"):
        GGUFFile(tmp_path)


@pytest.mark.parametrize("content", [b"", b"GG", b"PK\x03\x04 a zip file", b"not a model at all" * 10])
def test_not_gguf(tmp_path, content):
    p = tmp_path / "x.gguf"
    p.write_bytes(content)
    with pytest.raises(NotGGUF, match="not a GGUF file"):
        GGUFFile(p)


def test_truncated_everywhere(tmp_path, tiny_path):
    data = tiny_path.read_bytes()
    cuts = sorted({5, 16, 24, 100, 1000, 5000, len(data) // 2, len(data) - 1000, len(data) - 1})
    for cut in cuts:
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(CorruptModelFile, match="truncated"):
            GGUFFile(p)


def _rewrite(tmp_path, src, mutate):
    """Copy a GGUF with mutate(writer, key, value) deciding each metadata field."""
    r = gguf.GGUFReader(str(src))
    out = tmp_path / "mut.gguf"
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), mutate.get("general.architecture", arch))
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        key = k.replace(f"{arch}.", f"{mutate.get('general.architecture', arch)}.")
        t = f.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, f.contents(), t, sub_type=f.types[-1])
        else:
            w.add_key_value(key, f.contents(), t)
    for t in r.tensors:
        data = mutate.get(("tensor", t.name), None)
        if data is None:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
        else:
            w.add_tensor(t.name, data[0], raw_dtype=data[1])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return out


def test_unsupported_architecture_is_named(tmp_path, tiny_path):
    p = _rewrite(tmp_path, tiny_path, {"general.architecture": "mamba"})
    with pytest.raises(UnsupportedArchitecture) as e:
        GGUFFile(p)
    assert "'mamba'" in str(e.value) and "llama" in str(e.value) and "qwen2" in str(e.value)


def test_rope_scaling_is_read_or_refused_by_name(tmp_path, tiny_factory):
    path = tiny_factory(TinySpec(yarn=32.0))
    rope = GGUFFile(path).config.layers[0].rope
    assert rope.linear_scale == 32.0 and rope.yarn.orig_context == 512 // 8 and rope.yarn.ext_factor == 1.0
    assert "yarn" not in json.dumps(GGUFFile(tiny_factory(TinySpec())).config.kv_shape())  # older files' shapes
    data = path.read_bytes()
    value = len(b"yarn").to_bytes(8, "little") + b"yarn"  # a GGUF string: its length, then its bytes
    assert data.count(value) == 1
    (tmp_path / "rope.gguf").write_bytes(data.replace(value, len(b"ntk!").to_bytes(8, "little") + b"ntk!"))
    with pytest.raises(UnsupportedArchitecture, match="rope scaling 'ntk!' is not supported; linear and yarn are"):
        GGUFFile(tmp_path / "rope.gguf")


def test_unsupported_tensor_type_is_named(tmp_path, tiny_path):
    ints = np.arange(64 * 4, dtype=np.int32).reshape(4, 64)
    p = _rewrite(tmp_path, tiny_path, {("tensor", "blk.0.ffn_norm.weight"): (ints, Q.I32)})
    with pytest.raises(UnsupportedTensorType, match=r"blk\.0\.ffn_norm\.weight.*I32"):
        GGUFFile(p)


def test_missing_tensor_is_named(tmp_path, tiny_path):
    from kvsession.engine import Engine

    r = gguf.GGUFReader(str(tiny_path))
    out = tmp_path / "missing.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        t = f.types[0]
        w.add_key_value(k, f.contents(), t, sub_type=f.types[-1] if t == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        if t.name != "blk.1.attn_v.weight":
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(MissingTensor, match=r"blk\.1\.attn_v\.weight"):
        Engine.load(out)


def test_original_file_untouched_by_failed_loads(tmp_path, tiny_path):
    copy = tmp_path / "copy.gguf"
    shutil.copy(tiny_path, copy)
    before = copy.read_bytes()
    GGUFFile(copy).fingerprint
    assert copy.read_bytes() == before


def test_metadata_reads_as_the_gguf_reader_does(tmp_path, tiny_path):
    """Our one-pass metadata reader against llama.cpp's gguf reader: every field of the tiny file and of one
    with every value type and nested arrays (the writer refuses empty ones)."""
    r = gguf.GGUFReader(str(tiny_path))
    ours = GGUFFile(tiny_path).reader.values
    assert {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")} == ours
    V = gguf.GGUFValueType
    extra = {"x.u8": (7, V.UINT8), "x.i8": (-7, V.INT8), "x.u16": (700, V.UINT16), "x.i16": (-700, V.INT16),
             "x.i32": (-70000, V.INT32), "x.u64": (2**40, V.UINT64), "x.i64": (-(2**40), V.INT64),
             "x.f64": (0.25, V.FLOAT64), "x.bool": (True, V.BOOL), "x.str": ("héllo", V.STRING),
             "x.strs": (["a", "", "ü"], V.ARRAY), "x.floats": ([0.5, -1.0], V.ARRAY),
             "x.nested": ([[1, 2], [3]], V.ARRAY)}
    out = _rewrite_with(tmp_path, tiny_path, extra)
    r = gguf.GGUFReader(str(out))
    ours = GGUFFile(out).reader.values
    for key in extra:
        if key != "x.nested":
            assert ours[key] == r.fields[key].contents(), key
    assert ours["x.nested"] == [[1, 2], [3]]  # the gguf reader flattens it (its FIXME); nothing we read is nested


def test_a_metadata_string_that_is_not_utf8_fails_only_when_read(tmp_path, tiny_path):
    out = _rewrite_with(tmp_path, tiny_path, {"x.note": ("HELLOWORLD", gguf.GGUFValueType.STRING)})
    data = out.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data.replace(b"HELLOWORLD", b"\xffELLOWORLD"))
    f = GGUFFile(bad)  # the model does not need that field
    with pytest.raises(CorruptModelFile, match="'x.note' is unreadable"):
        f.meta("x.note")


def _rewrite_with(tmp_path, src, extra):
    """A copy of a GGUF with extra metadata fields {key: (value, type)}."""
    r = gguf.GGUFReader(str(src))
    out = tmp_path / "extra.gguf"
    w = gguf.GGUFWriter(str(out), r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        t = f.types[0]
        w.add_key_value(k, f.contents(), t, sub_type=f.types[-1] if t == gguf.GGUFValueType.ARRAY else None)
    for k, (value, t) in extra.items():
        sub = None
        if t == gguf.GGUFValueType.ARRAY:
            sub = gguf.GGUFValueType.STRING if any(isinstance(v, str) for v in value) else None
        w.add_key_value(k, value, t, sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return out


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0])
def test_fast_dequantization_is_bit_for_bit_gguf_quants(qtype):
    """The whole-array Q8_0 / Q5_0 paths give gguf.quants' float32 values exactly, whatever the bytes (scales
    of either sign, every high-bit pattern), for rows and for a single row."""
    rng = np.random.default_rng(3)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(40, 6 * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    blocks[:, :2] = rng.uniform(-3, 3, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    got, want = gguf_reader.dequantize_rows(raw, qtype), np.asarray(gguf.quants.dequantize(raw, qtype), np.float32)
    assert got.shape == want.shape == (40, 6 * 32) and got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(gguf_reader.dequantize_rows(raw[7], qtype), want[7])


def test_arrays_nested_beyond_reason_are_a_corrupt_header(tmp_path, tiny_path):
    """A metadata array of arrays of arrays ... 100,000 deep: one line of error, not a RecursionError."""
    import struct

    data = tiny_path.read_bytes()
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    key = b"x.deep"
    deep = struct.pack("<Q", len(key)) + key + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 100_000
    bad = tmp_path / "deep.gguf"  # the field goes first; the file stays otherwise as it was
    bad.write_bytes(data[:16] + struct.pack("<Q", n_kv + 1) + deep + data[24:])
    with pytest.raises(CorruptModelFile, match="corrupt GGUF header"):
        GGUFFile(bad)
