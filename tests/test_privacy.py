"""Privacy at rest: the folders that hold conversations are their owner's alone (0700), their files too
(0600), whatever the umask; the shared tier's key names are hashes, never a conversation's text or tokens."""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
from test_store import PREFIX, SMALL, session_of

from kvsession.files.named import make_folder
from kvsession.server.call_memory import ToolCallMemory
from kvsession.server.reply_events import ToolCall
from kvsession.server.responses.stored import StoredResponses
from kvsession.store import Store


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def open_umask():
    """The umask most systems start with in a shared group's setup: group and others may read and enter."""
    old = os.umask(0o002)
    yield
    os.umask(old)


def test_the_cache_folder_and_its_files_are_the_owners_alone(tiny_engine, tmp_path, open_umask):
    store = Store(tmp_path / "a" / "kv", SMALL)
    e = store.put(session_of(tiny_engine, PREFIX + [7] * 20), "continued")
    assert e is not None
    folders = [store.dir, store.dir / "chunks", store.dir / "manifests", store.dir / "stats"]
    assert [oct(mode(d)) for d in folders] == [oct(0o700)] * 4
    written = [p for d in folders for p in d.iterdir() if p.is_file()] + [store.dir / "store.json"]
    assert len(written) > len(e.chunks) and {oct(mode(p)) for p in written} == {oct(0o600)}
    assert store.restore(store.longest_prefix(e.tokens.tolist(), tiny_engine), tiny_engine.session())
    assert store.flush(timeout=60)
    stats = list((store.dir / "stats").iterdir())
    assert stats and {oct(mode(p)) for p in stats} == {oct(0o600)}  # a hit's statistics file, written since


def test_a_folder_someone_made_keeps_its_mode(tmp_path, open_umask):
    (tmp_path / "kv").mkdir(mode=0o750)
    Store(tmp_path / "kv", SMALL)
    assert mode(tmp_path / "kv") == 0o750  # the owner's choice; the parts made here are private
    assert mode(tmp_path / "kv" / "chunks") == 0o700


def test_the_sessions_folder_and_a_saved_session_are_the_owners_alone(tiny_engine, tmp_path, open_umask):
    folder = tmp_path / "data" / "sessions"
    make_folder(folder)
    session_of(tiny_engine, PREFIX).save(folder / "chat.kvs")
    assert mode(folder) == 0o700 and mode(folder / "chat.kvs") == 0o600


def test_stored_responses_and_tool_calls_are_the_owners_alone(tmp_path, open_umask):
    records = StoredResponses(tmp_path / "kv" / "responses", 1 << 20)
    records.put("resp_1", {"messages": [{"role": "user", "content": "my secret"}], "response": {"id": "resp_1"}},
                "k1")
    assert mode(tmp_path / "kv" / "responses") == 0o700 and mode(tmp_path / "kv" / "responses" / "resp_1.json") == 0o600
    memory = ToolCallMemory(tmp_path / "kv" / "tool_calls.jsonl", capacity=1)
    for i in range(3):  # appended, then rewritten past twice the capacity
        memory.remember([f"call_{i}"], "my secret call", [ToolCall("f", "{}")])
    assert mode(tmp_path / "kv" / "tool_calls.jsonl") == 0o600


KEY_NAME = re.compile(r"kvsession:[0-9a-f]{32}:[cmt]:[0-9a-f]{32}")


def test_the_shared_tiers_key_names_carry_no_conversation(tiny_engine, tmp_path):
    from kvsession.testing.valkey import LocalValkey
    from test_store_valkey import shared

    server = LocalValkey(tmp_path)
    server.start()
    try:
        store = Store(tmp_path / "kv", shared(server.url))
        text = "My card number is 4111 1111 1111 1111"
        ids = tiny_engine.tokenizer.encode(text * 3)
        store.put(session_of(tiny_engine, ids), "continued")
        assert store.flush(timeout=60)
        names = [k.decode() for k in server.client().keys("*")]
        # chain root, kind, key: hashes alone (a tail's token ids are inside its hash's fields, with the data)
        assert names and all(KEY_NAME.fullmatch(n) for n in names), names
        store.close()
    finally:
        server.stop()
