"""Disks that fail under a running server: a FUSE passthrough under the cache and sessions folders that returns
EIO on chosen reads and writes, ENOSPC after N bytes, or short writes (kvsession.testing.faultfs), and a real
small tmpfs that fills up.

Under each: every request is answered, never a 5xx, never a hang; the cache's breaker logs once and the
server goes on without the cache, and recovers when the fault clears; a session saved onto a full or failing
disk is a clear error and leaves the previous file as it was; a chunk whose read fails is a miss, never
served (the reply is the one computed without it)."""
from __future__ import annotations

import errno
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_proc import Server

from kvsession.testing import wait_until
from kvsession.testing.faultfs import FaultFS

why_not = FaultFS.available()
needs_fuse = pytest.mark.skipif(why_not is not None, reason=f"no fault file system here: {why_not}")

SYSTEM = "You are a careful assistant who answers in one short line. " * 2
UNUSABLE = "the disk KV cache is unusable"


def turn(history: list[dict], text: str) -> list[dict]:
    return history + [{"role": "user", "content": text}]


class Traffic:
    """A server whose cache and sessions folders lie on `disk`, and the requests of a test."""

    def __init__(self, model, tmp: Path, disk: Path):
        self.tmp, self.disk = tmp, disk
        self.server = Server(model, tmp, "--precision", "f32", "--kv-disk-dir", disk / "kv", "--sessions-dir",
                             disk / "sessions", "--kv-disk-min-tokens", 16, "--kv-cache-chunk-tokens", 16,
                             "--kv-cache-continued-interval-tokens", 16,  # every request writes: checkpoints
                             "--kv-disk-retry", 0.5, "--trace", tmp / "trace.jsonl")

    def chat(self, messages: list[dict]) -> str:
        r = httpx.post(self.server.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "system", "content": SYSTEM}, *messages], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text  # whatever the disk does
        return r.json()["choices"][0]["message"]["content"]

    def source(self) -> str:
        """Where the last request's prefix came from: live, disk or cold."""
        return json.loads((self.tmp / "trace.jsonl").read_text().splitlines()[-1])["source"]

    def store(self) -> dict:
        return self.server.health()["store"]

    def log(self) -> str:
        return Path(self.server.log.name).read_text()

    def save(self, name: str) -> httpx.Response:
        return httpx.post(self.server.url + f"/v1/sessions/{name}/save", timeout=120)

    def recovers(self) -> None:
        """Requests go on until the cache is used again (tried every 0.5 s): a bound, not a timing."""
        for i in range(300):
            self.chat([{"role": "user", "content": f"after the fault {i}"}])
            if self.store()["status"] == "ok":
                return
            time.sleep(0.1)
        raise AssertionError(f"the cache did not come back: {self.store()}")

    def verify(self) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvsession", "cache", "verify", "--dir", str(self.disk / "kv")],
                              capture_output=True, text=True, timeout=300)


@pytest.fixture
def disk(tmp_path):
    if why_not is not None:
        pytest.skip(f"no fault file system here: {why_not}")
    with FaultFS(tmp_path / "backing", tmp_path / "mnt") as fs:
        yield fs


@needs_fuse
def test_a_chunk_whose_read_fails_is_a_miss_never_served(tiny_path, tmp_path, disk):
    t = Traffic(tiny_path, tmp_path, disk.mount)
    try:
        one = [{"role": "user", "content": "Tell me about the sea and the wind, in a line."}]
        reply = t.chat(one)
        two = turn(one + [{"role": "assistant", "content": reply}], "And about the hills?")
        expected = t.chat(two)  # the live session: what a cold prefill gives too
        t.server.stop()  # the conversation checkpointed at shutdown
        disk.set(read_eio=["*.kvc"])
        t.server.start()
        assert t.chat(two) == expected and t.source() == "cold"  # its chunks unreadable: a miss
        assert t.store()["status"] == "ok"  # one damaged entry is a miss, not a failing cache
        disk.clear()
        three = turn(two + [{"role": "assistant", "content": expected}], "And the rivers?")
        expected = t.chat(three)
        t.server.stop()
        t.server.start()
        assert t.chat(three) == expected and t.source() == "disk"  # the fault cleared: restores again
    finally:
        t.server.stop()


@needs_fuse
@pytest.mark.parametrize("fault", [{"enospc_after": 0}, {"enospc_after": 3000}, {"write_eio": ["kv/*"]}],
                         ids=["full", "full-midway", "eio"])
def test_writes_that_fail_cost_the_cache_once_and_it_comes_back(tiny_path, tmp_path, disk, fault):
    t = Traffic(tiny_path, tmp_path, disk.mount)
    try:
        t.chat([{"role": "user", "content": "A first conversation, kept on disk."}])
        disk.set(**fault)
        for i in range(6):  # each checkpointed cold: the store's writes fail, the requests do not
            t.chat([{"role": "user", "content": f"Conversation {i} while the disk fails, long enough to keep."}])
        wait_until(lambda: t.store()["status"] == "degraded", 60, "the failing cache was not noticed")
        reason = t.store()["reason"]
        assert ("No space left" if "enospc_after" in fault else "Input/output error") in reason, reason
        assert t.log().count(UNUSABLE) == 1 and "Traceback" not in t.log()  # logged once, however many calls
        disk.clear()
        t.recovers()
        assert "the disk KV cache works again" in t.log()
        kept = [{"role": "user", "content": "A conversation after the disk came back, kept on disk."}]
        expected = t.chat(kept)
        t.server.stop()
        r = t.verify()
        assert r.returncode == 0 and "removed 0 damaged, 0 dangling" in r.stdout, r.stdout + r.stderr
        t.server.start()
        assert t.chat(kept) == expected and t.source() == "disk"
    finally:
        t.server.stop()


@needs_fuse
def test_short_writes_lose_nothing(tiny_path, tmp_path, disk):
    disk.set(short_writes=True)  # every write takes half of what it is given: the writers must loop
    t = Traffic(tiny_path, tmp_path, disk.mount)
    try:
        one = [{"role": "user", "content": "Tell me about the sea and the wind, in a line."}]
        expected = t.chat(one)
        assert t.save("short").status_code == 200
        t.server.stop()
        r = t.verify()
        assert r.returncode == 0 and "removed 0 damaged, 0 dangling, 0 orphan, 0 temporary" in r.stdout, r.stdout
        t.server.start()
        assert t.chat(one) == expected and t.source() == "disk"
        assert httpx.post(t.server.url + "/v1/sessions/short/restore", timeout=120).status_code == 200
    finally:
        t.server.stop()


@needs_fuse
@pytest.mark.parametrize("fault", [{"enospc_after": 0}, {"enospc_after": 5000}, {"write_eio": ["sessions/*"]}],
                         ids=["full", "full-midway", "eio"])
def test_a_session_saved_onto_a_failing_disk_is_an_error_and_the_old_file_stays(tiny_path, tmp_path, disk, fault):
    t = Traffic(tiny_path, tmp_path, disk.mount)
    try:
        one = [{"role": "user", "content": "Remember: the keys are under the mat."}]
        t.chat(one)
        assert t.save("keep").status_code == 200
        path = disk.mount / "sessions" / "keep.kvs"
        before = path.read_bytes()
        t.chat(turn(one, "And the spare key is in the shed, next to the long blue ladder."))
        disk.set(**fault)
        r = t.save("keep")
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_not_saved", r.text
        assert ("No space left" if "enospc_after" in fault else "Input/output error") in r.text, r.text
        disk.clear()
        assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == ["keep.kvs"]
        assert t.save("keep").status_code == 200 and path.read_bytes() != before
    finally:
        t.server.stop()


def test_a_real_filesystem_that_fills_up(tiny_path, tmp_path):
    from test_hostile_files import tiny_filesystem

    with tiny_filesystem(tmp_path / "small", "4m") as small:
        t = Traffic(tiny_path, tmp_path, small)
        try:
            one = [{"role": "user", "content": "Remember: the keys are under the mat."}]
            t.chat(one)
            assert t.save("keep").status_code == 200
            before = (small / "sessions" / "keep.kvs").read_bytes()
            filler = small / "filler"
            try:  # every block the file system has left
                with open(filler, "wb") as f:
                    while True:
                        f.write(b"\0" * 4096)
                        f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
            for i in range(6):
                t.chat([{"role": "user", "content": f"Conversation {i} on a full disk, long enough to keep."}])
            wait_until(lambda: t.store()["status"] == "degraded", 60, "the full cache was not noticed")
            assert "No space left" in t.store()["reason"] and t.log().count(UNUSABLE) == 1
            t.chat(turn(one, "And the spare key is in the shed."))
            r = t.save("keep")
            assert r.status_code == 409 and "No space left" in r.text, r.text
            assert (small / "sessions" / "keep.kvs").read_bytes() == before
            filler.unlink()
            t.recovers()
            assert t.save("keep").status_code == 200
        finally:
            t.server.stop()
