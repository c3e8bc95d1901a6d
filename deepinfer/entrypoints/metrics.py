"""The server's Prometheus metrics (prometheus_client), in a registry of their own per server.

Gauges are read from the engine thread's latest snapshot (AsyncLLM.stats) when /metrics is scraped; latencies
are observed as outputs reach the HTTP handlers: TTFT from the request's arrival at the server to its first
token, inter-token latency as the gap between deliveries that brought new tokens, divided over those tokens.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class _EngineCollector:
    """Engine gauges computed at scrape time from AsyncLLM.stats()."""

    GAUGES = (("num_requests_running", "running", "Sequences in the running batch"),
              ("num_requests_waiting", "waiting", "Sequences waiting to be scheduled"),
              ("kv_cache_usage_perc", "kv_usage", "Fraction of KV blocks in use (1 = all)"),
              ("kv_blocks_total", "kv_blocks_total", "KV blocks in the pool"),
              ("kv_blocks_free", "kv_blocks_free", "KV blocks free (cached-but-unused blocks count as free)"),
              ("prefix_cache_hit_rate", "prefix_cache_hit_rate", "Prompt tokens served by the prefix cache / looked up"),
              ("prefix_cache_queries_tokens", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
              ("prefix_cache_hits_tokens", "prefix_cache_hits", "Prompt tokens found in the prefix cache"),
              ("engine_steps", "steps", "Engine steps since start-up"),
              ("spec_decode_draft_tokens", "spec_draft_tokens", "Draft tokens proposed (speculative decoding)"),
              ("spec_decode_accepted_tokens", "spec_accepted_tokens", "Draft tokens accepted"),
              ("spec_decode_acceptance_rate", "spec_acceptance_rate", "Accepted / proposed draft tokens"))

    def __init__(self, engine, model: str):
        self.engine, self.model = engine, model

    def collect(self):
        stats = self.engine.stats()
        for name, key, doc in self.GAUGES:
            g = GaugeMetricFamily(f"deepinfer_{name}", doc, labels=["model_name"])
            g.add_metric([self.model], float(stats.get(key, 0)))
            yield g


class ServerMetrics:
    def __init__(self, engine, model: str):
        self.registry = CollectorRegistry()
        self.model = model
        self.registry.register(_EngineCollector(engine, model))
        labels = ["model_name"]
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds", "Time to first token", labels,
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("deepinfer_inter_token_latency_seconds", "Time between output tokens", labels,
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("deepinfer_e2e_request_latency_seconds", "Request latency, arrival to last token",
                             labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("deepinfer_requests", "Finished requests by endpoint and finish reason",
                                ["model_name", "endpoint", "finish_reason"], registry=self.registry)
        self.errors = Counter("deepinfer_request_errors", "Requests answered with an error, by kind",
                              ["model_name", "kind"], registry=self.registry)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens", labels, registry=self.registry)
        self.generation_tokens = Counter("deepinfer_generation_tokens", "Generated tokens", labels,
                                         registry=self.registry)
        self.in_flight = Gauge("deepinfer_http_requests_in_flight", "Generation requests being served", labels,
                               registry=self.registry)

    def error(self, kind: str) -> None:
        self.errors.labels(self.model, kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency observations of one request, fed with its cumulative outputs."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics
        self.start = self.last = time.perf_counter()
        self.tokens = 0

    def observe(self, out) -> None:
        n = sum(len(c.token_ids) for c in out.outputs)
        if n > self.tokens:
            now = time.perf_counter()
            if self.tokens == 0:
                self.m.ttft.labels(self.m.model).observe(now - self.start)
            else:
                gap = (now - self.last) / (n - self.tokens)
                for _ in range(min(n - self.tokens, 64)):
                    self.m.itl.labels(self.m.model).observe(gap)
            self.tokens, self.last = n, now

    def finish(self, out, endpoint: str) -> None:
        m = self.m
        m.e2e.labels(m.model).observe(time.perf_counter() - self.start)
        m.prompt_tokens.labels(m.model).inc(len(out.prompt_token_ids))
        m.generation_tokens.labels(m.model).inc(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:
            m.requests.labels(m.model, endpoint, c.finish_reason or "none").inc()
