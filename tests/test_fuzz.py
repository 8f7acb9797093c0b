"""The readers fuzzed, briefly and deterministically (tools/fuzz.py's targets and mutator, seeded): the session
file, the raw import, the store's manifests and chunks, and a shared tier's payloads. Every input is refused
with its typed error or read back exactly; the long coverage-guided runs are tools/fuzz.py's. The cases below
are what the fuzzer found, each now a miss."""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from kvsession.files import framing

FUZZ = Path(__file__).resolve().parent.parent / "tools" / "fuzz.py"
INPUTS = 600  # a target; the targets take a few milliseconds an input


@pytest.fixture(scope="module")
def fuzz():
    spec = importlib.util.spec_from_file_location("kvsession_fuzz", FUZZ)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def harness(fuzz, tmp_path_factory):
    h = fuzz.Harness(tmp_path_factory.mktemp("fuzz"))
    yield h
    h.close()


@pytest.mark.parametrize("target", ["session", "raw", "manifest", "chunk", "valkey"])
def test_seeded_mutations_are_refused_or_read_exactly(fuzz, harness, target):
    run = fuzz.run_target(harness, target)
    run(harness.seeds[target])  # the seed itself reads back
    rng = random.Random(f"kvsession {target}")
    for _ in range(INPUTS):
        run(fuzz.mutate(harness.seeds[target], rng))


def rewritten(data: bytes, change) -> bytes:
    """A framing file with change(fields) applied to its header, the header's checksum made right."""
    h = framing.parse_header(data, len(data))
    fields = dict(h.fields)
    change(fields)
    table = [{"name": s.name, "offset": s.offset, "length": s.length, "xxh3": f"{s.xxh3:016x}"} for s in h.sections]
    header = framing._preamble(fields, table, "fuzzed")
    return header + data[h.data_start :]


def test_a_manifest_without_one_of_its_layers_is_a_miss(harness):
    """Found by the fuzzer: the layer left out passed every check and the restore raised, not a miss."""
    data = rewritten(harness.seeds["manifest"], lambda f: f.update(layers=f["layers"][1:]))
    harness.manifest(data)  # a miss: no exception, nothing outside
    store = harness.store_with({harness.manifest_file(): data})
    assert store.entries == {}  # refused when the folder is read
    store.close()


@pytest.mark.parametrize("layer", [{}, {"kind": 7}, "full"])
def test_a_manifest_whose_fingerprint_layer_has_no_kind_is_a_miss(harness, layer):
    """Found by the fuzzer: a fingerprint layer without its kind raised KeyError out of the store's open."""
    def change(f):
        f["fingerprint"]["kv_shape"]["layers"][0] = layer

    data = rewritten(harness.seeds["manifest"], change)
    harness.manifest(data)  # a miss: no exception, nothing outside
    store = harness.store_with({harness.manifest_file(): data})
    assert store.entries == {}
    store.close()


def test_a_chunk_without_one_of_its_layers_is_a_miss(harness):
    data = rewritten(harness.seeds["chunk"], lambda f: f.update(layers=f["layers"][1:]))
    harness.chunk(data)
    store = harness.store_with({harness.chunk_file(): data})
    hit = store.longest_prefix(harness.good.tokens, harness.engine)
    assert hit is not None and store.restore(hit, harness.engine.session()) is False  # a miss, and removed
    assert store.entries == {}
    store.close()


@pytest.mark.parametrize("name", [b"../../../../escaped", b"\xff\xfe not text", b"CE7A" * 8])
def test_a_shared_tier_naming_a_manifest_by_what_is_no_key_is_a_miss(fuzz, harness, name):
    """Found by reading, then by the fuzzer: a tail hash's value became a file name (a path out of the folder)
    or a UnicodeDecodeError out of a lookup."""
    held = fuzz.decode_keys(harness.seeds["valkey"])
    (tails,) = [k for k, v in held.items() if isinstance(v, dict)]
    (manifest,) = [k for k in held if b":m:" in k]
    field, key = next(iter(held[tails].items()))
    held[tails] = {field: name}
    held[manifest.replace(key, name)] = held.pop(manifest)
    harness.valkey(fuzz.encode_keys(held))  # no exception, nothing written outside the folder
    store = harness.shared_store(held)
    hit = store.longest_prefix(harness.good.tokens, harness.engine)
    assert hit is None or hit.entry is None  # at most the chunks it holds: never that manifest
    store.close()
    assert not list(harness.scratch.parent.glob("escaped*")) and not list(harness.scratch.rglob("escaped*"))
