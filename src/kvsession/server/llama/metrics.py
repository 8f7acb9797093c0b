"""GET /metrics (with --metrics): Prometheus' text format, written by the official prometheus_client library.

Nothing is counted here: at each scrape a collector reads what the worker
counted (stats.py's ServerStats) and the state of the moment (the running
set, the live sessions, the store), and prometheus_client writes it.
llama-server's names where a figure means the same (`llamacpp:...`: a
dashboard made for llama-server reads this server), kvsession's own under
`kvsession_`. One difference prometheus_client makes: every counter's name
ends in _total, so llama-server's `llamacpp:n_tokens_max` counter, a
maximum, is a gauge here.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..worker import Worker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SHARED_STATES = ("ok", "degraded", "down")


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class ServerCollector:
    """The worker's figures, read when scraped."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def collect(self):
        w = self.worker
        st = w.stats
        yield _counter("llamacpp:prompt_tokens", "Number of prompt tokens processed.", st.prompt_tokens)
        yield _counter("llamacpp:prompt_tokens_cached", "Number of prompt tokens reused from a cache.",
                       sum(st.reused.values()))
        yield _counter("llamacpp:prompt_seconds", "Prompt process time.", st.prompt_seconds)
        yield _counter("llamacpp:tokens_predicted", "Number of generation tokens processed.", st.predicted_tokens)
        yield _counter("llamacpp:tokens_predicted_seconds", "Predict process time.", st.predicted_seconds)
        yield _counter("llamacpp:n_decode", "Passes through the model (llama_decode() calls).", st.passes)
        yield _gauge("llamacpp:n_tokens_max", "Largest observed n_tokens of one pass.", st.max_pass_tokens)
        yield _counter("llamacpp:spec_decode_num_drafts", "Speculative drafts verified.", st.drafts)
        yield _counter("llamacpp:spec_decode_num_draft_tokens", "Tokens drafted.", st.draft_tokens)
        yield _counter("llamacpp:spec_decode_num_accepted_tokens", "Drafted tokens accepted.", st.accepted_tokens)
        yield _gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                     st.prompt_tokens / st.prompt_seconds if st.prompt_seconds else 0.0)
        yield _gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                     st.predicted_steps / st.predicted_seconds if st.predicted_seconds else 0.0)
        yield _gauge("llamacpp:requests_processing", "Number of requests processing.", len(w.running))
        deferred = len(w.waiting) + w.jobs.qsize()
        yield _gauge("llamacpp:requests_deferred", "Number of requests deferred.", deferred)
        yield _gauge("llamacpp:n_busy_slots_per_decode", "Average number of busy slots per decode pass.",
                     st.busy_slots / st.decode_passes if st.decode_passes else 0.0)
        yield from self.own(w)

    def own(self, w: Worker):
        st = w.stats
        tokens = CounterMetricFamily("kvsession_prompt_tokens", "Prompt tokens by where their KV came from: "
                                     "prefilled, or reused from a live session, the disk cache or the shared tier.",
                                     labels=["source"])
        tokens.add_metric(["prefilled"], st.prompt_tokens)
        for source in ("live", "disk", "shared"):
            tokens.add_metric([source], st.reused.get(source, 0))
        yield tokens
        yield _counter("kvsession_requests", "Generation requests finished.", st.requests)
        yield _counter("kvsession_context_shifts", "Context shifts (--context-shift).", st.context_shifts)
        h = st.restores
        cumulative, buckets = 0, []
        for bound, n in zip([*map(str, h.bounds), "+Inf"], h.counts):
            cumulative += n
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily("kvsession_restore_seconds", "Restores from the disk KV cache and their time.",
                                    buckets=buckets, sum_value=h.total)
        yield _gauge("kvsession_queue_depth", "Requests waiting for a place in the running set.", len(w.waiting)
                     + w.jobs.qsize())
        yield _gauge("kvsession_live_sessions", "Conversations held in memory.", len(w.live))
        yield _gauge("kvsession_live_session_bytes", "Memory of the live sessions' KV (the spare's included).",
                     w.live.nbytes())
        store = w.store
        if store is None:
            return
        yield _gauge("kvsession_disk_cache_up", "1 while the disk KV cache is usable.",
                     0 if w.store_health.reason else 1)
        yield _gauge("kvsession_disk_cache_bytes", "Bytes of the disk KV cache's checkpoints and chunks.",
                     store.total_bytes())
        yield _counter("kvsession_disk_cache_evictions", "Checkpoints evicted for the disk budget.",
                       store.local.evictions)
        yield _counter("kvsession_checkpoints_written", "Checkpoints written to the disk KV cache.", store.written)
        yield _counter("kvsession_checkpoint_bytes", "Bytes checkpoints added to the disk KV cache.",
                       store.written_bytes)
        if store.shared is not None:
            state = store.shared.state()["status"]
            g = GaugeMetricFamily("kvsession_shared_tier_state", "The shared tier's state (1 for the current one).",
                                  labels=["state"])
            for s in SHARED_STATES:
                g.add_metric([s], 1 if s == state else 0)
            yield g


def registry(worker: Worker) -> CollectorRegistry:
    r = CollectorRegistry(auto_describe=False)
    r.register(ServerCollector(worker))
    return r


def exposition(r: CollectorRegistry) -> bytes:
    return generate_latest(r)
