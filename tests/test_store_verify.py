"""`kvsession cache verify` (Store.verify_all): every checksum and reference checked; what is damaged or
dangling removed, and said; nothing sound removed, and what stays restores exactly."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from test_store import PREFIX, SMALL, session_of

from kvsession.sampling import GREEDY
from kvsession.store import Store


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(data)


def chunk(folder: Path, key: str) -> Path:
    return folder / "chunks" / f"{key}.kvc"


def manifest(folder: Path, key: str) -> Path:
    return folder / "manifests" / f"{key}.kvm"


def restores_exactly(store: Store, engine, tokens: list[int]) -> bool:
    hit = store.longest_prefix(tokens, engine)
    s = engine.session(sampler=GREEDY)
    if hit is None or hit.n_tokens != len(tokens) or not store.restore(hit, s):
        return False
    return s.tokens == tokens and torch.equal(s.logits, session_of(engine, tokens).logits)


def test_a_sound_folder_loses_nothing(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    conversations = [PREFIX + [k] * (10 + k) for k in range(5, 9)]  # shared chunks, tails of every length
    keys = {store.put(session_of(tiny_engine, ids), "continued").key for ids in conversations}
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    again = Store(tmp_path, SMALL)
    assert again.verify_all() == [] and set(again.entries) == keys
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == files
    assert all(restores_exactly(again, tiny_engine, ids) for ids in conversations)


def test_damage_and_dangling_references_are_removed_and_said(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    ids = {k: PREFIX + [k] * 20 for k in range(5, 11)}  # each: two shared chunks, one of its own, a tail of 12
    e = {k: store.put(session_of(tiny_engine, t), "continued") for k, t in ids.items()}
    flip(chunk(tmp_path, e[5].chunks[2]), -40)  # a row's byte: the chunk damaged, 5 dangling
    flip(manifest(tmp_path, e[6].key), -40)  # a row's byte: 6 damaged, its own chunk an orphan
    chunk(tmp_path, e[7].chunks[2]).unlink()  # 7 dangling
    shutil.copy(chunk(tmp_path, e[9].chunks[2]), chunk(tmp_path, e[8].chunks[2]))  # another chunk under 8's name
    flip(manifest(tmp_path, e[10].key), 20)  # its header: removed when the folder is opened
    (tmp_path / "chunks" / f".{e[9].chunks[2]}.kvc.x1y2.tmp").write_bytes(b"half a chunk")
    (tmp_path / "stats" / f"{'0' * 32}.json").write_text("{}")
    store.close()

    store = Store(tmp_path, SMALL)
    removed = store.verify_all()
    said = {(r.kind, r.path.name) for r in removed}
    assert said == {
        ("damaged", f"{e[5].chunks[2]}.kvc"), ("dangling", f"{e[5].key}.kvm"),
        ("damaged", f"{e[6].key}.kvm"), ("orphan", f"{e[6].chunks[2]}.kvc"),
        ("dangling", f"{e[7].key}.kvm"),
        ("damaged", f"{e[8].chunks[2]}.kvc"), ("dangling", f"{e[8].key}.kvm"),
        ("damaged", f"{e[10].key}.kvm"), ("orphan", f"{e[10].chunks[2]}.kvc"),
        ("temporary", f".{e[9].chunks[2]}.kvc.x1y2.tmp"), ("orphan", f"{'0' * 32}.json"),
    }, removed
    assert all(r.why for r in removed) and "not chunk 2 of this chain" in str(removed)
    assert set(store.entries) == {e[9].key}  # the one sound checkpoint, and what it names
    assert {p.stem for p in (tmp_path / "chunks").iterdir()} == set(e[9].chunks)
    assert restores_exactly(store, tiny_engine, ids[9])
    assert store.verify_all() == []
    for k in (5, 6, 7, 8):  # what was removed is a miss down to the shared chunks, never a wrong restore
        hit = store.longest_prefix(ids[k], tiny_engine)
        assert hit.n_tokens == 32 and hit.chunks == e[9].chunks[:2]


def test_a_manifest_whose_chain_is_not_its_tokens_is_damaged(tiny_engine, tmp_path):
    """Checksums that hold over content that does not match its names (a bug, a file put together by hand)."""
    from kvsession.files import framing

    store = Store(tmp_path, SMALL)
    a = store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    path = manifest(tmp_path, a.key)
    with framing.open_regular(path) as f:
        h = framing.read_header(f, str(path))
        sections = [(s.name, [bytes(framing.read_section(f, h, s.name, where=str(path)))]) for s in h.sections]
    fields = {**h.fields, "chunks": [h.fields["chunks"][1], h.fields["chunks"][0], h.fields["chunks"][2]]}
    fields["chunk_bytes"] = [h.fields["chunk_bytes"][i] for i in (1, 0, 2)]
    framing.write_file(path, fields, sections)
    removed = Store(tmp_path, SMALL).verify_all()
    assert [(r.kind, r.why) for r in removed if r.kind != "orphan"] == \
        [("damaged", "its chunk keys are not the chain of its tokens")]


def test_cache_verify_says_what_it_removed(tiny_engine, tmp_path):
    from test_cli import kvsession

    store = Store(tmp_path, SMALL)
    a = store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    store.put(session_of(tiny_engine, PREFIX + [6] * 20), "continued")
    r = kvsession("cache", "verify", "--dir", tmp_path)
    assert r.returncode == 0 and "2 checkpoints and 4 chunks sound" in r.stdout and "removed 0 damaged" in r.stdout
    flip(chunk(tmp_path, a.chunks[2]), -40)
    r = kvsession("cache", "verify", "--dir", tmp_path)
    assert r.returncode == 1, r.stderr
    assert f"removed damaged chunks/{a.chunks[2]}.kvc: " in r.stdout and "checksum mismatch" in r.stdout
    assert f"removed dangling manifests/{a.key}.kvm: chunk 2 ({a.chunks[2][:12]}) is damaged" in r.stdout
    assert "1 checkpoints and 3 chunks sound" in r.stdout and "removed 1 damaged, 1 dangling, 0 orphan" in r.stdout
    r = kvsession("cache", "verify", "--dir", tmp_path)
    assert r.returncode == 0 and "removed 0 damaged, 0 dangling, 0 orphan, 0 temporary" in r.stdout
