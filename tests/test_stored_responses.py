"""The Responses API's stored records (server/stored.py): a chain of continuations costs its messages once, keeps
to its budget through a thousand records, and never serves a partial history."""
from __future__ import annotations

import json
import uuid

import pytest

from kvsession.server.responses.stored import StoredResponses

OWNER = "k1"


def rid() -> str:
    return f"resp_{uuid.uuid4().hex}"


def turn(k: int, size: int = 1000) -> list[dict]:
    return [{"role": "user", "content": f"question {k} " + "q" * size},
            {"role": "assistant", "content": f"answer {k}"}]


def folder_bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.json"))


def chain(records: StoredResponses, n: int, size: int = 1000) -> list[tuple[str, list[dict]]]:
    """n continuations, each the previous one's conversation and one more turn, as the API stores them."""
    made, parent, history = [], None, []
    for k in range(n):
        history = history + turn(k, size)
        r = rid()
        records.put(r, {"messages": history, "response": {"id": r}}, OWNER, parent)
        made.append((r, history))
        parent = r
    return made


@pytest.mark.parametrize("on_disk", [True, False], ids=["folder", "memory"])
def test_a_chain_stores_each_turn_once(tmp_path, on_disk):
    folder = tmp_path / "responses" if on_disk else None
    records = StoredResponses(folder, 64 << 20)
    made = chain(records, 200)
    one_turn = len(json.dumps(turn(0)))
    assert records.total < 2 * 200 * one_turn  # the whole history again each turn would be ~100 times this
    if on_disk:
        assert folder_bytes(folder) == records.total
    for r, history in made[::37] + made[-1:]:
        got = records.get(r, OWNER)
        assert got["messages"] == history and got["response"] == {"id": r}
    assert records.get(made[-1][0], "another key") is None


def test_a_thousand_records_keep_to_the_budget_and_never_lose_a_history(tmp_path):
    folder = tmp_path / "responses"
    budget = 400 << 10
    records = StoredResponses(folder, budget)
    made = []
    for branch in range(10):  # ten conversations of a hundred turns, interleaved with one-shot responses
        made += chain(records, 100, size=300)
        for _ in range(5):
            r = rid()
            records.put(r, {"messages": turn(-1), "response": {"id": r}}, OWNER)
        assert folder_bytes(folder) <= budget and records.total == folder_bytes(folder)
    stored = [(r, h) for r, h in made if (folder / f"{r}.json").exists()]
    assert 0 < len(stored) < len(made)  # the oldest left
    for r, history in stored:  # what is still there reads whole: its parents' messages were handed down
        assert records.get(r, OWNER)["messages"] == history
    for r, _ in made:
        if (r, _) not in stored:
            assert records.get(r, OWNER) is None
    newest = made[-1][0]
    reopened = StoredResponses(folder, budget)  # after a restart, from the folder's listing
    assert reopened.get(newest, OWNER)["messages"] == made[-1][1]
    reopened.put(rid(), {"messages": turn(0), "response": {}}, OWNER)
    assert reopened.total == folder_bytes(folder) <= budget


def test_deleting_a_turn_keeps_its_continuations(tmp_path):
    records = StoredResponses(tmp_path / "responses", 64 << 20)
    made = chain(records, 5)
    fork = rid()  # a second continuation of turn 2
    records.put(fork, {"messages": made[2][1] + turn(99), "response": {}}, OWNER, made[2][0])
    assert not records.delete(made[2][0], "another key")
    assert records.delete(made[2][0], OWNER) and records.get(made[2][0], OWNER) is None
    assert records.get(made[3][0], OWNER)["messages"] == made[3][1]
    assert records.get(fork, OWNER)["messages"] == made[2][1] + turn(99)
    assert records.delete(made[0][0], OWNER)
    reopened = StoredResponses(tmp_path / "responses", 64 << 20)
    for r, history in made[3:]:
        assert reopened.get(r, OWNER)["messages"] == history


def test_a_conversation_over_the_budget_is_not_stored_and_leaves_the_rest(tmp_path):
    records = StoredResponses(tmp_path / "responses", 20 << 10)
    made = chain(records, 30)  # 1 kB a turn: from about the 19th, the conversation is over 20 kB
    kept = [k for k, (r, _) in enumerate(made) if records.get(r, OWNER) is not None]
    assert kept and kept[-1] < 25 and records.get(made[kept[-1]][0], OWNER)["messages"] == made[kept[-1]][1]
    assert records.total <= 20 << 10


def test_a_continuation_that_rewrites_its_history_is_stored_whole(tmp_path):
    """previous_response_id whose messages the new record does not open with (a client that edited them):
    no link, the conversation as given."""
    records = StoredResponses(tmp_path / "responses", 64 << 20)
    (first, _), = chain(records, 1)
    r = rid()
    records.put(r, {"messages": turn(7), "response": {}}, OWNER, first)
    assert records.get(r, OWNER)["messages"] == turn(7)
    assert records.delete(first, OWNER) and records.get(r, OWNER)["messages"] == turn(7)


def test_a_write_killed_mid_way_leaves_nothing_after_a_restart(tmp_path):
    folder = tmp_path / "responses"
    records = StoredResponses(folder, 64 << 20)
    [(kept, history)] = chain(records, 1)
    (folder / f".{uuid.uuid4().hex}.json.k1ll3d.tmp").write_bytes(b'{"half": ')  # no lock: its writer is dead
    reopened = StoredResponses(folder, 64 << 20)
    assert reopened.get(kept, OWNER)["messages"] == history
    assert [p.name for p in folder.iterdir() if p.name.endswith(".tmp")] == []
