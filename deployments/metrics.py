"""Prometheus metrics for `GET /metrics`, named `mlx_paged_serve:` + vLLM's suffixes
so dashboards built for vLLM map over.

Latency histograms and token counters are observed at the ingress, where the client's
view of time is. Engine gauges and counters come from each `LLMServer` replica's
latest stats snapshot (sent along with every finished request and on each scrape),
summed over the replicas heard from recently.
"""

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

P = "mlx_paged_serve:"
_LAT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0)
STALE_AFTER_S = 120.0


class _ReplicaStats:
    """A prometheus collector over the latest snapshot of each replica."""

    GAUGES = {
        "num_requests_running": ("running", "Requests running on the engines."),
        "num_requests_waiting": ("waiting", "Requests waiting for the engines."),
        "kv_cache_usage_perc": ("kv_cache_usage", "Fraction of KV blocks held by requests (mean over replicas)."),
        "kv_cache_bytes_in_use": ("kv_cache_bytes_in_use", "KV bytes held by requests."),
        "kv_cache_bytes_peak": ("kv_cache_bytes_peak", "Most KV bytes ever held by requests at once."),
        "kv_cache_bytes_saved_by_sharing": ("kv_cache_bytes_saved_by_sharing",
                                            "KV bytes live requests would hold without block sharing."),
        "num_free_blocks": ("num_free_blocks", "Free KV blocks (cached or not)."),
        "num_cached_blocks": ("num_cached_blocks", "Blocks the prefix cache can serve."),
        "num_window_slots_in_use": ("window_slots_in_use",
                                    "Window slots (sliding-window layers' K/V) held by requests."),
        "device_memory_active_bytes": ("device_memory_active_bytes", "MLX memory in use by the engines."),
        "device_memory_cache_bytes": ("device_memory_cache_bytes",
                                      "Freed MLX buffers the engines keep for reuse (given back when idle)."),
        "device_memory_peak_bytes": ("device_memory_peak_bytes", "Most MLX memory the engines held at once."),
        "device_memory_cache_limit_bytes": ("device_memory_cache_limit_bytes",
                                            "The bound on freed MLX buffers the engines keep."),
    }
    COUNTERS = {
        "prefix_cache_queries": ("prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache."),
        "prefix_cache_hits": ("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache."),
        "prefix_cache_query_requests": ("prefix_cache_queries", "Prefix-cache lookups."),
        "prefix_cache_hit_requests": ("prefix_cache_hits", "Lookups that hit at least one block."),
        "num_preemptions": ("preemptions", "Sequences preempted for lack of KV blocks."),
        "window_slot_evictions": ("window_slot_evictions",
                                  "Window slots taken from blocks whose K/V a later prefix hit could have used."),
        "num_step_failures": ("step_failures", "Engine steps that raised; their requests were aborted."),
    }

    PER_REPLICA = {
        "replica_requests_finished": ("requests_finished", "Requests finished, per replica."),
        "replica_prefix_cache_query_tokens": ("prefix_cache_query_tokens", "Prefix-cache query tokens, per replica."),
        "replica_prefix_cache_hit_tokens": ("prefix_cache_hit_tokens", "Prefix-cache hit tokens, per replica."),
    }

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshots: dict[str, tuple[float, dict]] = {}

    def update(self, stats: dict | None) -> None:
        if stats and stats.get("replica_id"):
            self.snapshots[stats["replica_id"]] = (time.monotonic(), stats)

    def collect(self):
        now = time.monotonic()
        live = [s for t, s in self.snapshots.values() if now - t < STALE_AFTER_S]
        labels = ["model_name"]
        for name, (key, doc) in self.GAUGES.items():
            g = GaugeMetricFamily(P + name, doc, labels=labels)
            vals = [s.get(key, 0) for s in live]
            value = (sum(vals) / len(vals) if vals else 0.0) if name == "kv_cache_usage_perc" else sum(vals)
            g.add_metric([self.model_name], value)
            yield g
        for name, (key, doc) in self.COUNTERS.items():
            c = CounterMetricFamily(P + name, doc, labels=labels)
            c.add_metric([self.model_name], sum(s.get(key, 0) for s in live))
            yield c
        yield self._step_times(live, labels)
        for name, (key, doc) in self.PER_REPLICA.items():
            c = CounterMetricFamily(P + name, doc, labels=labels + ["replica"])
            for s in live:
                c.add_metric([self.model_name, s["replica_id"]], s.get(key, 0))
            yield c

    def _step_times(self, live: list[dict], labels: list[str]) -> HistogramMetricFamily:
        """The engines' step durations, summed over replicas: the steps that stall a
        loop (and every request waiting for its turn) land in the top buckets."""
        h = HistogramMetricFamily(P + "engine_step_duration_seconds", "Duration of engine steps.",
                                  labels=labels)
        with_steps = [s for s in live if s.get("step_time_counts")]
        bounds = with_steps[0]["step_time_bounds_s"] if with_steps else ()
        counts = [sum(c) for c in zip(*(s["step_time_counts"] for s in with_steps))] or [0]
        cumulative, buckets = 0, []
        for bound, n in zip([*map(str, bounds), "+Inf"], counts):
            cumulative += n
            buckets.append((bound, cumulative))
        h.add_metric([self.model_name], buckets, sum(s.get("step_seconds_total", 0.0) for s in with_steps))
        return h


class _StoreStats:
    """The app's store (response_store.py), as its replica last reported it on a scrape:
    how many responses, conversations and chat completions it holds and their bytes.
    Nothing is reported for an app without a store."""

    GAUGES = {
        "stored_responses": ("responses", "Responses the store holds."),
        "stored_response_bytes": ("bytes", "Bytes of the stored responses' JSON."),
        "stored_conversations": ("conversations", "Conversations the store holds."),
        "stored_conversation_bytes": ("conversation_bytes", "Bytes of the conversations' items."),
        "stored_chat_completions": ("chat_completions", "Chat completions the store holds."),
        "stored_chat_completion_bytes": ("chat_completion_bytes", "Bytes of the stored chat completions."),
    }

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: dict | None = None

    def collect(self):
        if self.stats is None:
            return
        for name, (key, doc) in self.GAUGES.items():
            g = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], self.stats.get(key, 0))
            yield g


class _PromptTokenStats:
    """The ingress's prompt token cache (runtime/prompt_token_cache.py): long prompts
    tokenized only past the start they share with a recent one, and their tokens taken
    from it. Nothing is reported without the cache."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.cache = None

    def collect(self):
        if self.cache is None:
            return
        stats = dict(self.cache.stats)
        c = CounterMetricFamily(P + "prompt_token_cache_prompts", "Long prompts tokenized, by how: "
                                "reused (from a cached prompt's start) or whole.", labels=["model_name", "how"])
        for how in ("reused", "whole"):
            c.add_metric([self.model_name, how], stats[how])
        yield c
        r = CounterMetricFamily(P + "prompt_token_cache_reused_tokens",
                                "Prompt tokens taken from cached prompts instead of tokenized.", labels=["model_name"])
        r.add_metric([self.model_name], stats["reused_tokens"])
        yield r
        g = GaugeMetricFamily(P + "prompt_token_cache_enabled",
                              "1 while the prompt token cache is on (it turns off for good if a reuse was wrong).",
                              labels=["model_name"])
        g.add_metric([self.model_name], float(self.cache.enabled))
        yield g


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        lab = ["model_name"]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=_LAT, registry=self.registry)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between output tokens.", lab,
                             buckets=_LAT, registry=self.registry)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency, end to end.", lab,
                             buckets=_LAT, registry=self.registry)
        self.queue = Histogram(P + "request_queue_time_seconds",
                               "Time in the engine's waiting queue, to first scheduling.", lab,
                               buckets=_LAT, registry=self.registry)
        self.prefill = Histogram(P + "request_prefill_time_seconds",
                                 "Time from first scheduling to the first token, in the engine.", lab,
                                 buckets=_LAT, registry=self.registry)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", lab,
                                     registry=self.registry)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", lab,
                                         registry=self.registry)
        self.success = Counter(P + "request_success", "Finished requests.", lab + ["finished_reason"],
                               registry=self.registry)
        self.errors = Counter(P + "request_errors", "Requests answered with an error.", lab + ["status"],
                              registry=self.registry)
        self.replicas = _ReplicaStats(model_name)
        self.registry.register(self.replicas)
        self.store = _StoreStats(model_name)
        self.registry.register(self.store)
        self.prompt_token_cache = _PromptTokenStats(model_name)
        self.registry.register(self.prompt_token_cache)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes TTFT, inter-token latency and e2e for one request, from `start`: when the
    request arrived (the first output is awaited before the response starts, so a timer
    started then would leave the prefill out)."""

    def __init__(self, metrics: Metrics, start: float):
        self.m = metrics
        self.start = self.last = start
        self.first = None

    def output(self, out) -> None:
        """One engine output: its new tokens, and on the first, the engine's queue and
        prefill times."""
        m = out.metrics
        if self.first is None and m is not None and m.prefill_time is not None:
            name = self.m.model_name
            self.m.queue.labels(name).observe(m.queue_time)
            self.m.prefill.labels(name).observe(m.prefill_time)
        self.tokens(sum(len(o.delta_token_ids) for o in out.outputs))

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        name = self.m.model_name
        if self.first is None:
            self.first = self.last = now
            self.m.ttft.labels(name).observe(now - self.start)
            n -= 1
        if n > 0:
            gap = (now - self.last) / n
            for _ in range(n):
                self.m.itl.labels(name).observe(gap)
        self.last = now

    def done(self, prompt_tokens: int, completion_tokens: int, reasons: list[str | None]) -> None:
        name = self.m.model_name
        self.m.e2e.labels(name).observe(time.monotonic() - self.start)
        self.m.prompt_tokens.labels(name).inc(prompt_tokens)
        self.m.generation_tokens.labels(name).inc(completion_tokens)
        for r in reasons:
            self.m.success.labels(name, r or "abort").inc()
