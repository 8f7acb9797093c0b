"""kvsession bench --long --sides: the main conversation's turn after side conversations, and where it came from."""
from __future__ import annotations

import functools

from kvsession.bench.long import _conversation
from kvsession.bench.server import Server


def test_the_turn_after_the_sides_says_where_it_came_from(tiny_path, tmp_path):
    """Past a budget of a few of the tiny model's sessions, the sides push the main conversation out of memory
    and it comes back from the disk cache: the server's own trace says so."""
    start = functools.partial(Server, str(tiny_path), tmp_path, "--precision", "f32", "--live-kv-mb", "1",
                              "--kv-disk-dir", tmp_path / "kv", "--kv-disk-min-tokens", "16")
    main = "The main conversation's own system prompt, long enough to be checkpointed. " * 3
    sides = [f"Side task {k}: another text altogether, nothing shared with the main one. " * 2 for k in range(12)]
    f = _conversation(start, main, "And one more question.", False, sides)
    assert f["from"] == "disk"
    assert f["after_cached"] > f["prompt"] and f["after_prompt"] > f["after_cached"]
    assert f["next"] > 0 and f["after"] > 0
