"""llama-server's native API on kvsession serve: /completion, /infill, /tokenize, /detokenize, /apply-template,
/props, /slots, /metrics and --context-shift, over HTTP on a tiny model with Qwen2.5-Coder's FIM tokens; then
the hostile inputs of those routes; then /infill and /completion on the real Qwen2.5-Coder-0.5B."""
from __future__ import annotations

import base64
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from server_proc import Server
from tiny import TinySpec

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json"

KEY = "test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
FIM = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def fim_model(tiny_factory):
    return tiny_factory(TinySpec(specials=FIM, context=1024))


@pytest.fixture(scope="module")
def server(fim_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama")
    s = Server(fim_model, tmp, "--precision", "f32", "--metrics", "--parallel", "2", "--api-key", KEY,
               "--alias", "zz-other,tiny-fim", "--tags", "fim,small", "--embeddings")
    s.tmp = tmp
    yield s
    s.stop()


def post(server, path, body=None, **kw):
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120, **kw)


def get(server, path):
    return httpx.get(server.url + path, headers=AUTH, timeout=60)


def events(server, path, body):
    """A native stream's data objects (llama-server ends it without [DONE])."""
    out = []
    with httpx.stream("POST", server.url + path, json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
    return out


def metrics(server) -> dict:
    r = get(server, "/metrics")
    assert r.status_code == 200 and (b"Process-Start-Time-Unix", str(r.headers["process-start-time-unix"]).encode()) \
        in r.headers.raw  # the name in llama-server's case
    return {s.name: s.value for family in text_string_to_metric_families(r.text) for s in family.samples
            if not s.labels}


# --- /completion ---


def test_completion_answers_in_llama_servers_shape(server):
    r = post(server, "/completion", {"prompt": "the sea", "n_predict": 6, "return_tokens": True, **GREEDY})
    assert r.status_code == 200, r.text
    b = r.json()
    t = b["timings"]
    assert b["stop"] is True and b["model"] == "tiny-fim" and b["prompt"] == "the sea"
    assert t["predicted_n"] == b["tokens_predicted"] == len(b["tokens"]) <= 6
    assert t["prompt_n"] + t["cache_n"] == b["tokens_evaluated"]
    assert b["tokens_cached"] == b["tokens_evaluated"] + b["tokens_predicted"]
    assert b["stop_type"] in ("limit", "eos") and b["generation_settings"]["n_predict"] == 6
    assert isinstance(b["has_new_line"], bool) and b["truncated"] is False
    assert post(server, "/completions", {"prompt": "the sea", "n_predict": 6, **GREEDY}).json()["content"] == \
        b["content"]
    assert post(server, "/completion", {"prompt": "the sea", "n_predict": 6, **GREEDY}).json()["tokens"] == []


def test_a_stream_is_the_same_reply_in_chunks(server):
    whole = post(server, "/completion", {"prompt": "the sea", "n_predict": 8, **GREEDY}).json()
    chunks = events(server, "/completion", {"prompt": "the sea", "n_predict": 8, "stream": True, **GREEDY})
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert all(c["tokens"] for c in chunks[:-1])
    assert "".join(c["content"] for c in chunks) == whole["content"]
    last = chunks[-1]
    assert last["timings"]["predicted_n"] == whole["timings"]["predicted_n"]
    assert last["stop_type"] == whole["stop_type"] and "generation_settings" in last


def test_prompts_as_ids_mixed_and_several(server):
    text = "the sea is"
    ids = post(server, "/tokenize", {"content": text}).json()["tokens"]
    one = post(server, "/completion", {"prompt": text, "n_predict": 4, **GREEDY}).json()["content"]
    assert post(server, "/completion", {"prompt": ids, "n_predict": 4, **GREEDY}).json()["content"] == one
    assert post(server, "/completion", {"prompt": {"prompt_string": text}, "n_predict": 4, **GREEDY}).json()[
        "content"] == one
    many = post(server, "/completion", {"prompt": [ids, text], "n_predict": 4, **GREEDY}).json()
    assert [m["content"] for m in many] == [one, one] and [m["index"] for m in many] == [0, 1]
    mixed = post(server, "/completion", {"prompt": ids[:1] + [text[1:]], "n_predict": 2, **GREEDY})
    assert mixed.status_code == 200 and isinstance(mixed.json()["content"], str)
    r = post(server, "/completion", {"prompt": {"prompt_string": "x", "multimodal_data": "AAAA"}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_n_probs_and_post_sampling_probs(server):
    b = post(server, "/completion", {"prompt": "the sea", "n_predict": 4, "n_probs": 3, **GREEDY}).json()
    probs = b["completion_probabilities"]
    assert len(probs) == b["tokens_predicted"]
    for p in probs:
        assert p["logprob"] <= 0 and len(p["top_logprobs"]) == 3 and isinstance(p["bytes"], list)
        assert p["top_logprobs"][0]["logprob"] >= p["top_logprobs"][-1]["logprob"]
    b = post(server, "/completion", {"prompt": "the sea", "n_predict": 4, "n_probs": 5, "post_sampling_probs": True,
                                     "temperature": 1.0, "top_k": 3, "seed": 1}).json()
    for p in b["completion_probabilities"]:
        assert 0 < p["prob"] <= 1 and 0 < len(p["top_probs"]) <= 3  # top_k 3 leaves at most 3
        assert sum(t["prob"] for t in p["top_probs"]) == pytest.approx(1.0)
        assert p["id"] in [t["id"] for t in p["top_probs"]]


def test_the_same_prompt_again_samples_from_its_prefills_logits(server):
    """A prompt sent again reuses all of it, its last token's logits included (the server marks each prompt's end):
    nothing is recomputed, and the same seed draws the same reply with the same probabilities."""
    body = {"prompt": "the rain on the roof of the house", "n_predict": 6, "n_probs": 4, "post_sampling_probs": True,
            "temperature": 1.0, "seed": 9}
    first, again = (post(server, "/completion", body).json() for _ in range(2))
    assert again["timings"]["prompt_n"] == 0 and again["timings"]["cache_n"] == first["tokens_evaluated"]
    assert again["completion_probabilities"] == first["completion_probabilities"]


def test_samplers_stop_and_response_fields(server):
    full = post(server, "/completion", {"prompt": "the sea", "n_predict": 12, **GREEDY}).json()["content"]
    stop = next(full[i:i + 2] for i in range(1, len(full) - 1) if full[i:i + 2].isascii())  # not a split character
    b = post(server, "/completion", {"prompt": "the sea", "n_predict": 12, "stop": [stop], **GREEDY}).json()
    assert b["content"] == full[: full.index(stop)] and b["stop_type"] == "word" and b["stopping_word"] == stop
    r = post(server, "/completion", {"prompt": "the sea", "n_predict": 3, "samplers": ["top_k", "temperature"],
                                     "response_fields": ["content", "generation_settings/samplers", "nope/x"]})
    assert r.status_code == 200 and set(r.json()) == {"content", "generation_settings/samplers"}
    assert r.json()["generation_settings/samplers"] == ["top_k", "temperature"]
    banned = post(server, "/completion", {"prompt": "the sea", "n_predict": 8, "logit_bias": [[full[0], False]],
                                          **GREEDY}).json()
    assert banned["content"] != full


def test_ignore_eos_bans_the_end_of_generation(server):
    b = post(server, "/completion", {"prompt": "the sea", "n_predict": 3, "ignore_eos": True, **GREEDY}).json()
    biases = b["generation_settings"]["logit_bias"]
    assert biases and all(e["bias"] is None for e in biases)
    assert b["tokens_predicted"] == 3
    b = post(server, "/completion", {"prompt": "the sea", "n_predict": 3, **GREEDY}).json()
    assert b["generation_settings"]["logit_bias"] == []


# --- /infill ---


EXTRA = [{"filename": "util.py", "text": "def helper(x):\n    return x + 1\n" * 6},
         {"filename": "names.py", "text": "NAMES = ['a', 'b']\n" * 6}]


def test_infill_lays_out_the_fim_prompt_as_llama_server(server):
    r = post(server, "/infill", {"input_extra": EXTRA[:1], "input_prefix": "def f(x):\n", "prompt": "    ret",
                                 "input_suffix": "\n\nprint(f(2))\n", "n_predict": 4,
                                 "response_fields": ["prompt", "content"], **GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == ("<|repo_name|>myproject\n<|file_sep|>util.py\n" + EXTRA[0]["text"]
                                  + "<|file_sep|>filename\n<|fim_prefix|>def f(x):\n    ret<|fim_suffix|>\n\n"
                                  "print(f(2))\n<|fim_middle|>")


def test_infill_text_that_looks_like_a_control_token_stays_text(server):
    def evaluated(prefix):
        return post(server, "/infill", {"input_prefix": prefix, "input_suffix": "", "n_predict": 1,
                                        **GREEDY}).json()["tokens_evaluated"]

    assert evaluated("<|fim_middle|>") > evaluated("x") + 5  # its bytes, not one control token


def test_an_edit_near_the_cursor_keeps_the_extra_context_cached(server):
    body = {"input_extra": EXTRA, "input_suffix": "\n", "n_predict": 2, "id_slot": 0, **GREEDY}
    first = post(server, "/infill", {**body, "input_prefix": "x = helper("}).json()["timings"]
    then = post(server, "/infill", {**body, "input_prefix": "y = helper(NAMES"}).json()["timings"]
    assert then["cache_n"] > first["prompt_n"] // 2  # the chunks, from the live session
    assert then["prompt_n"] < first["prompt_n"] // 2


# --- /tokenize, /detokenize, /apply-template, /props, /health ---


def test_tokenize_detokenize_and_pieces(server):
    text = "the sea \u5abd"
    ids = post(server, "/tokenize", {"content": text}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json()["content"] == text
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and all(p["piece"] for p in pieces)
    # add_special adds only what the vocabulary asks for: this model's add_bos_token is false, as Qwen2.5's is
    assert post(server, "/tokenize", {"content": text, "add_special": True}).json()["tokens"] == ids
    assert post(server, "/tokenize", {"content": "<|fim_pad|>"}).json()["tokens"] != \
        post(server, "/tokenize", {"content": "<|fim_pad|>", "parse_special": False}).json()["tokens"]


def test_apply_template_is_the_chat_prompt(server):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    r = post(server, "/apply-template", {"messages": msgs})
    assert r.json()["prompt"] == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" \
                                 "<|im_start|>assistant\n"
    assert post(server, "/apply-template", {"messages": msgs, "add_generation_prompt": False}).json()[
        "prompt"].endswith("hi<|im_end|>\n")


# --- llama-server's fields on chat completions ---


CHAT = [{"role": "system", "content": "the sky"}, {"role": "user", "content": "the sea"}]


def test_json_object_with_a_schema_and_the_json_schema_field(server):
    for extra in ({"response_format": {"type": "json_object", "schema": {"const": "42"}}},
                  {"json_schema": {"const": "42"}}):
        r = post(server, "/chat/completions", {"messages": CHAT, "max_tokens": 8, **extra})
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["choices"][0]["message"]["content"]) == "42"
    r = post(server, "/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object", "schema": 5}})
    assert r.status_code == 400


def test_verbose_input_tokens_and_the_assistant_prefill(server):
    r = post(server, "/chat/completions", {"messages": CHAT, "max_tokens": 2, "verbose": True, **GREEDY}).json()
    assert r["__verbose"]["prompt"].startswith("<|im_start|>system\nthe sky")
    assert "__verbose" not in post(server, "/chat/completions", {"messages": CHAT, "max_tokens": 2}).json()
    counted = post(server, "/v1/chat/completions/input_tokens", {"messages": CHAT}).json()["input_tokens"]
    assert counted == r["usage"]["prompt_tokens"]
    # a last assistant message is the reply's start (llama-server's assistant prefill), unless asked otherwise
    started = CHAT + [{"role": "assistant", "content": "the rain"}]
    body = {"messages": started, "max_tokens": 2, "verbose": True, **GREEDY}
    assert post(server, "/chat/completions", body).json()["__verbose"]["prompt"].endswith(
        "<|im_start|>assistant\nthe rain")
    closed = post(server, "/chat/completions", {**body, "continue_final_message": False}).json()
    assert closed["__verbose"]["prompt"].endswith("the rain<|im_end|>\n<|im_start|>assistant\n")
    r = post(server, "/chat/completions", {**body, "continue_final_message": True, "add_generation_prompt": True})
    assert r.status_code == 400 and "choose one" in r.json()["error"]["message"]


def test_a_chat_stream_shows_the_prefills_progress(server):
    body = {"messages": [{"role": "user", "content": "the sea is wide and the sky " * 20}], "max_tokens": 2,
            "stream": True, "return_progress": True, **GREEDY}
    with httpx.stream("POST", server.url + "/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert progress and progress[0]["processed"] == progress[0]["cache"]
    assert progress[-1]["processed"] == progress[-1]["total"] > progress[0]["processed"]
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks)


def test_responses_carry_llama_servers_telemetry_when_asked(server):
    body = {"input": "the sea is wide and the sky " * 20, "max_output_tokens": 4, "stream": True,
            "return_progress": True, "timings_per_token": True, **GREEDY}
    with httpx.stream("POST", server.url + "/responses", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        seen = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    progress = [e["prompt_progress"] for e in seen if "prompt_progress" in e]
    assert progress and progress[-1]["processed"] == progress[-1]["total"]
    assert all(e["type"] == "response.in_progress" for e in seen if "prompt_progress" in e)
    deltas = [e for e in seen if e["type"] == "response.output_text.delta"]
    assert deltas and all("predicted_per_second" in e["timings"] for e in deltas)
    completed = seen[-1]
    assert completed["type"] in ("response.completed", "response.incomplete")
    assert completed["timings"]["predicted_n"] == completed["response"]["usage"]["output_tokens"]
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "return_progress": False,
                                                                   "timings_per_token": False},
                      headers=AUTH, timeout=120) as r:
        assert not any("timings" in line or "prompt_progress" in line for line in r.iter_lines())


def test_props_and_health(server, fim_model):
    p = get(server, "/props").json()
    assert p["model_path"] == str(fim_model) and p["total_slots"] == 2 and p["infill"] is True
    assert p["default_generation_settings"]["n_ctx"] == 1024 and p["build_info"].startswith("b")
    assert p["chat_template"].startswith("{% for message")
    for path in ("/health", "/v1/health"):
        assert httpx.get(server.url + path).json() == {"status": "ok"}  # no key needed
    r = httpx.get(server.url + "/props")
    assert r.status_code == 401 and r.json()["error"] == {"code": 401, "message": "invalid or missing API key",
                                                          "type": "authentication_error"}


def test_aliases_and_tags_as_llama_server_lists_them(server):
    m = get(server, "/models").json()["data"][0]
    assert m["id"] == "tiny-fim" and m["aliases"] == ["tiny-fim", "zz-other"] and m["tags"] == ["fim", "small"]
    assert get(server, "/v1/models/zz-other").json()["id"] == "tiny-fim"
    assert get(server, "/v1/models/other").status_code == 404


# --- /slots ---


def test_slots_save_restore_erase_as_named_sessions(server):
    prompt = {"prompt": "the sea is wide and the sea is deep", "n_predict": 4, **GREEDY}
    assert post(server, "/completion", {**prompt, "id_slot": 1}).json()["id_slot"] == 1
    slots = get(server, "/slots").json()
    assert [s["id"] for s in slots] == [0, 1] and not any(s["is_processing"] for s in slots)
    assert slots[1]["n_ctx"] == 1024 and slots[1]["n_tokens"] > 0
    saved = post(server, "/slots/1?action=save", {"filename": "sea.kvs-slot"}).json()
    assert saved["id_slot"] == 1 and saved["n_saved"] == slots[1]["n_tokens"] and saved["n_written"] > 0
    assert (server.tmp / "sessions" / "sea.kvs-slot.kvs").is_file()
    erased = post(server, "/slots/1?action=erase").json()
    assert erased == {"id_slot": 1, "n_erased": saved["n_saved"]}
    assert get(server, "/slots").json()[1]["n_tokens"] == 0
    restored = post(server, "/slots/0?action=restore", {"filename": "sea.kvs-slot"}).json()
    assert restored["n_restored"] == saved["n_saved"] and restored["timings"]["restore_ms"] >= 0
    again = post(server, "/completion", {**prompt, "id_slot": 0}).json()
    assert again["timings"]["cache_n"] == again["tokens_evaluated"] - 1  # the restored prompt, but one token
    missing = post(server, "/slots/0?action=restore", {"filename": "nothing-here"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


# --- /metrics ---


def test_metrics_scraped_by_the_prometheus_parser(server):
    before = metrics(server)
    bodies = [post(server, "/completion", {"prompt": "count me", "n_predict": n, **GREEDY}).json() for n in (1, 5)]
    after = metrics(server)
    predicted = sum(b["timings"]["predicted_n"] for b in bodies)
    prefilled = sum(b["timings"]["prompt_n"] for b in bodies)
    cached = sum(b["timings"]["cache_n"] for b in bodies)
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == predicted
    assert after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"] == prefilled
    assert after["llamacpp:prompt_tokens_cached_total"] - before["llamacpp:prompt_tokens_cached_total"] == cached
    assert after["llamacpp:n_decode_total"] > before["llamacpp:n_decode_total"]
    assert after["llamacpp:requests_processing"] == 0 and after["kvsession_live_sessions"] >= 1
    assert after["kvsession_requests_total"] - before["kvsession_requests_total"] == 2
    families = {f.name: f for f in text_string_to_metric_families(get(server, "/metrics").text)}
    assert families["llamacpp:prompt_tokens"].type == "counter"
    assert families["kvsession_restore_seconds"].type == "histogram"
    sources = {s.labels["source"] for s in families["kvsession_prompt_tokens"].samples}
    assert sources == {"prefilled", "live", "disk", "shared"}
    samples = {s.name for f in families.values() for s in f.samples}
    wanted = set(re.findall(r"(?:kvsession_|llamacpp:)[a-z_]+", DASHBOARD.read_text()))
    server_only = {"kvsession_disk_cache_bytes", "kvsession_disk_cache_evictions_total"}  # with a disk cache
    assert wanted - server_only <= samples, wanted - samples


def test_embeddings_in_openais_shape_and_llama_servers(server):
    """--embeddings: the last token's output after the final norm (the tiny file names no pooling), Euclidean-
    normalized; counted in /metrics as llama-server counts them (prompt tokens and passes, nothing predicted)."""
    before = metrics(server)
    parts = {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}
    r = post(server, "/v1/embeddings", {"input": ["hello world", parts, [5, 6, "seven"]], "model": "any"}).json()
    vecs = [torch.tensor(d["embedding"]) for d in r["data"]]
    assert [d["index"] for d in r["data"]] == [0, 1, 2] and r["object"] == "list" and r["model"] == "tiny-fim"
    assert all(abs(float(v.norm()) - 1) < 1e-5 for v in vecs) and vecs[0].numel() == 64
    assert torch.equal(vecs[0], vecs[1]) and not torch.equal(vecs[0], vecs[2])
    counts = [len(post(server, "/tokenize", {"content": t}).json()["tokens"]) for t in ("hello world", "seven")]
    assert r["usage"] == {"prompt_tokens": 2 * counts[0] + 2 + counts[1], "total_tokens": 2 * counts[0] + 2 + counts[1]}
    after = metrics(server)
    assert after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"] == r["usage"]["prompt_tokens"]
    assert after["llamacpp:n_decode_total"] - before["llamacpp:n_decode_total"] == 3
    assert after["llamacpp:tokens_predicted_total"] == before["llamacpp:tokens_predicted_total"]
    b64 = post(server, "/v1/embeddings", {"input": "hello world", "encoding_format": "base64"}).json()
    assert torch.equal(torch.frombuffer(bytearray(base64.b64decode(b64["data"][0]["embedding"])), dtype=torch.float32),
                       vecs[0])
    native = post(server, "/embedding", {"content": "hello world", "embd_normalize": -1}).json()
    raw = torch.tensor(native[0]["embedding"][0])
    assert native[0]["index"] == 0 and len(native[0]["embedding"]) == 1 and torch.allclose(raw / raw.norm(), vecs[0])
    for body, words in [({"input": []}, "required"), ({"input": {"content": "text"}}, "text parts"),
                        ({"input": {"content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}}, "text parts"),
                        ({"input": "x", "dimensions": 8}, "dimensions"), ({"input": ["a"] * 2049}, "at most 2048"),
                        ({"input": [10 ** 9]}, "outside the vocabulary"), ({"input": "x", "encoding_format": "hex"}, "")]:
        r = post(server, "/v1/embeddings", body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
    # a long list beside a generation: both answered (that the list goes one input a turn of the worker's loop, not
    # ahead of the generation, is not asserted: it would be a timing)
    with ThreadPoolExecutor(2) as pool:
        many = pool.submit(post, server, "/v1/embeddings", {"input": [f"text {i}" for i in range(64)]})
        done = pool.submit(post, server, "/completion", {"prompt": "go on", "n_predict": 24, **GREEDY})
        assert len(many.result().json()["data"]) == 64 and done.result().json()["tokens_predicted"] >= 1


def test_embedding_pooling_none_and_a_server_without_embeddings(fim_model, tmp_path):
    s = Server(fim_model, tmp_path, "--precision", "f32", "--embeddings", "--pooling", "none")
    try:
        n = len(httpx.post(s.url + "/tokenize", json={"content": "hello hello hello"}).json()["tokens"])
        rows = httpx.post(s.url + "/embeddings", json={"input": "hello hello hello"}).json()[0]["embedding"]
        assert len(rows) == n and all(abs(float(torch.tensor(r).norm()) - 1) > 1e-3 for r in rows)  # not normalized
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "hello"})
        assert r.status_code == 400 and "not OAI compatible" in r.json()["error"]["message"]
    finally:
        s.stop()
    s = Server(fim_model, tmp_path, "--precision", "f32")
    try:
        for path in ("/v1/embeddings", "/embedding"):
            r = httpx.post(s.url + path, json={"input": "hello"})
            assert r.status_code == 501 and "--embeddings" in r.json()["error"]["message"], r.text
    finally:
        s.stop()


def test_a_chat_template_by_name_is_the_one_applied(tiny_path, tmp_path):
    """llama.cpp's test_apply_chat_template: --chat-template command-r, its text for a system and a user turn."""
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--chat-template", "command-r")
    try:
        msgs = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]
        r = httpx.post(s.url + "/apply-template", json={"messages": msgs}, timeout=60)
        assert r.json()["prompt"] == ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>"
                                      "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
                                      "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"), r.text
    finally:
        s.stop()


def test_metrics_and_slots_are_off_when_asked_and_two_addresses(tiny_path, tmp_path):
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--no-slots", "--host", "127.0.0.1,[::1]")
    try:
        v6 = s.url.replace("127.0.0.1", "[::1]")
        assert httpx.get(v6 + "/health").json()["status"] == "ok"  # llama-server's --host "127.0.0.1,::1"
        error(httpx.get(v6 + "/props", headers={"host": "evil.example"}), 403)
        for path in ("/metrics", "/slots"):
            r = httpx.get(s.url + path)
            assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error", r.text
        r = httpx.post(s.url + "/infill", json={"input_prefix": "a", "input_suffix": "b"})
        assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]
    finally:
        s.stop()


# --- --context-shift ---


def test_context_shift_goes_on_past_the_context(fim_model, tmp_path):
    s = Server(fim_model, tmp_path, "--precision", "f32", "--ctx", "64", "--context-shift", "--kv-disk-dir",
               tmp_path / "kv", "--kv-disk-min-tokens", "16", "--spec", "off")
    try:
        body = {"prompt": "the sea is wide " * 4, "n_predict": 100, "n_keep": 4, "ignore_eos": True, **GREEDY}
        b = httpx.post(s.url + "/completion", json=body, timeout=120).json()
        assert b["timings"]["predicted_n"] == 100 and b["truncated"] is True
        assert b["tokens_evaluated"] + 100 > 64
    finally:
        s.stop()
    without = Server(fim_model, tmp_path, "--precision", "f32", "--ctx", "64")
    try:
        b = httpx.post(without.url + "/completion", json=body, timeout=120).json()
        assert b["tokens_evaluated"] + b["timings"]["predicted_n"] == 63 and b["truncated"] is True
        long = httpx.post(without.url + "/completion", json={"prompt": "the sea " * 60}, timeout=60)
        err = long.json()["error"]
        assert long.status_code == 400 and err["type"] == "exceed_context_size_error" and err["n_ctx"] == 64
        assert "exceeds the available context size" in err["message"]
    finally:
        without.stop()


# --- hostile input ---


def error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) >= {"code", "message", "type"} and e["code"] == status  # llama-server's shape
    return e


@pytest.mark.parametrize("body", [
    {"prompt": [-1, 2]}, {"prompt": [10**12]}, {"prompt": [True, 3]}, {"prompt": []}, {"prompt": None},
    {"prompt": [[1], [2**40]]}, {"prompt": ["x"] * 17}, {"prompt": {"text": "x"}},
])
def test_bad_prompts_and_token_ids_are_400(server, body):
    assert "prompt" in error(post(server, "/completion", body), 400)["message"]


@pytest.mark.parametrize("path,body", [
    ("/detokenize", {"tokens": [-5]}), ("/detokenize", {"tokens": [10**9]}), ("/detokenize", {"tokens": ["a"]}),
    ("/completion", {"prompt": "x", "logit_bias": [[10**9, 1]]}),
    ("/completion", {"prompt": "x", "logit_bias": {"1": "a lot"}}),
    ("/completion", {"prompt": "x", "logit_bias": [[1, 2, 3]]}),
    ("/completion", {"prompt": "x", "n_probs": 10**6}), ("/completion", {"prompt": "x", "n_probs": -1}),
    ("/completion", {"prompt": "x", "n_predict": -5}), ("/completion", {"prompt": "x", "samplers": ["warp"]}),
    ("/completion", {"prompt": "x", "samplers": "kz"}), ("/completion", {"prompt": "x", "repeat_penalty": 1.3}),
    ("/completion", {"prompt": "x", "id_slot": 2}), ("/completion", {"prompt": "x", "id_slot": -7}),
    ("/completion", {"prompt": "x", "stop": ["a"] * 17}), ("/completion", {"prompt": "x", "grammar": "root ::= ("}),
    ("/infill", {"input_prefix": "a"}), ("/infill", {"input_prefix": "a", "input_suffix": [-1]}),
    ("/infill", {"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": 1, "text": "x"}]}),
    ("/infill", {"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "x"}]}),
    ("/infill", {"input_prefix": "a", "input_suffix": "b", "input_extra": "x"}),
    ("/apply-template", {"messages": []}), ("/apply-template", {"messages": [{"role": "user", "content": 5}]}),
    ("/tokenize", {"content": 5}),
])
def test_hostile_fields_are_400_in_llama_servers_shape(server, path, body):
    error(post(server, path, body), 400)


def test_ten_thousand_extra_chunks_are_refused_before_any_is_read(server):
    chunks = [{"filename": f"f{i}.py", "text": "x = 1\n"} for i in range(10_000)]
    e = error(post(server, "/infill", {"input_prefix": "a", "input_suffix": "b", "input_extra": chunks}), 400)
    assert "input_extra" in e["message"]
    assert post(server, "/completion", {"prompt": "still here", "n_predict": 1}).status_code == 200


def test_huge_texts_are_refused_before_they_are_tokenized(server):
    big = "y" * 2_000_000
    assert "context" in error(post(server, "/infill", {"input_prefix": big, "input_suffix": ""}), 400)["message"]
    assert "context" in error(post(server, "/tokenize", {"content": big}), 400)["message"]


@pytest.mark.parametrize("slot", ["2", "99", "-1", "abc", "1e3", "0x1", "\u0661"])
def test_slot_ids_out_of_range(server, slot):
    assert "slot" in error(post(server, f"/slots/{slot}?action=erase"), 400)["message"]


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", "/etc/passwd", ".hidden", "x\u0000y", "a" * 300,
                                  "", " "])
def test_path_tricks_in_slot_filenames(server, name):
    post(server, "/completion", {"prompt": "the sea", "n_predict": 1, "id_slot": 1})
    for action in ("save", "restore"):
        r = post(server, f"/slots/1?action={action}", {"filename": name})
        assert r.status_code == 400, (name, r.text)
    assert not (server.tmp / "escape.kvs").exists() and not (server.tmp / "sessions" / "a").exists()


def test_unknown_slot_action_and_missing_filename(server):
    error(post(server, "/slots/0?action=delete", {"filename": "x"}), 400)
    error(post(server, "/slots/0", {"filename": "x"}), 400)
    error(post(server, "/slots/0?action=save", {}), 400)


def test_the_guard_stands_in_front_of_the_native_routes(server):
    r = httpx.post(server.url + "/completion", content=b'{"prompt": "x"}',
                   headers={**AUTH, "content-type": "text/plain"})
    error(r, 415)
    r = httpx.post(server.url + "/infill", json={}, headers={**AUTH, "host": "evil.example"})
    error(r, 403)
    for path in ("/completion", "/slots/0?action=erase", "/tokenize"):
        error(httpx.post(server.url + path, json={"prompt": "x"}), 401)
    for path in ("/slots", "/metrics", "/props"):
        error(httpx.get(server.url + path), 401)


# --- the real model ---


@pytest.mark.slow
def test_infill_and_completion_on_qwen_coder(qwen_path, tmp_path):
    s = Server(qwen_path, tmp_path, "--ctx", "4096")
    try:
        body = {"input_extra": [{"filename": "llama.h", "text": "LLAMA_API int32_t llama_n_threads();\n"}],
                "input_prefix": "#include <cstdio>\n#include \"llama.h\"\n\nint main() {\n",
                "prompt": "    int n_threads = llama_", "input_suffix": "}\n", "n_predict": 12, **GREEDY}
        first = httpx.post(s.url + "/infill", json=body, timeout=300).json()
        assert first["content"].startswith("n_threads();"), first["content"]
        moved = httpx.post(s.url + "/infill", json={**body, "prompt": "    int n = llama_"}, timeout=300).json()
        assert moved["timings"]["cache_n"] > 20  # the repository header and llama.h, from the live session
        c = httpx.post(s.url + "/completion", json={"prompt": "def fibonacci(n):\n", "n_predict": 24, **GREEDY},
                       timeout=300).json()
        assert "fibonacci" in c["content"] or "return" in c["content"], c["content"]
    finally:
        s.stop()


# --- the context shift itself ---


def test_a_shift_rotates_the_kept_keys_to_their_new_positions(fim_model):
    """Layer 0's keys depend on the token and its position only: after a shift, the moved rows equal what a
    prefill of the kept tokens writes there (up to RoPE's rounding)."""
    from kvsession.engine import Engine

    engine = Engine.load(fim_model, device="cpu", precision="f32")
    ids = engine.tokenizer.encode("the sea is wide and the sea is deep and the rain is on the roof", add_bos=False)
    keep, discard = 3, 7
    s = engine.session(kv_dtype="f32")
    s.prefill(ids)
    logits = s.logits.clone()
    s.shift(keep, discard)
    kept = ids[:keep] + ids[keep + discard:]
    assert s.tokens == kept and s.shifted == keep and torch.equal(s.logits, logits)
    fresh = engine.session(kv_dtype="f32")
    fresh.prefill(kept)
    n = len(kept)
    assert torch.allclose(s.cache[0].k[:n], fresh.cache[0].k[:n], atol=1e-4)
    assert torch.equal(s.cache[0].v[:n], fresh.cache[0].v[:n])
    assert not torch.allclose(s.cache[1].k[keep:n], fresh.cache[1].k[keep:n], atol=1e-4)  # computed with more in view
    s.truncate(keep)
    assert s.shifted is None  # what is left is exact again


def test_a_shifted_session_is_stored_only_as_far_as_it_is_exact(fim_model, tmp_path):
    from kvsession.engine import Engine
    from kvsession.server.options import ServerOptions
    from kvsession.server.prefixes import Prefixes
    from kvsession.server.stats import ServerStats
    from kvsession.store import StoreOptions

    engine = Engine.load(fim_model, device="cpu", precision="f32")
    options = ServerOptions(kv_disk_dir=str(tmp_path / "kv"), store=StoreOptions(min_tokens=4, chunk_tokens=16))
    prefixes = Prefixes(engine, options, 512, ServerStats())
    try:
        live = prefixes.live.add(engine.session(max_tokens=512))
        live.session.prefill(engine.tokenizer.encode("the sea is wide " * 12, add_bos=False))
        live.session.shift(20, 10)
        prefixes.checkpoint("evict", live)
        assert [e.n_tokens for e in prefixes.store.entries.values()] == [20]
        assert live.saved_at == 20
    finally:
        prefixes.store.close(timeout=60)
