"""`GET /metrics`: the server's Prometheus metrics (prometheus-client's text format), in its own registry.

Counters: requests by endpoint and status, prompt and generated tokens; histograms: time to first token and
request latency; gauges read at scrape time: requests in flight, live sessions, and per replica of the rollout
service its running / waiting sequences, KV used / pinned / free tokens, prefix-cache hit rate, tokens/s.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_REPLICA = (("running", "sequences prefilling or decoding"), ("waiting", "sequences waiting for a slot"),
            ("kv_used_tokens", "KV tokens in use"), ("kv_pinned_tokens", "KV tokens pinned by waiting sessions"),
            ("kv_free_tokens", "KV tokens free"), ("prefix_hit_rate", "prompt tokens found in the prefix cache"),
            ("tokens_per_s", "tokens prefilled and decoded per second"), ("steps", "engine steps so far"))


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("tiderl_http_requests", "HTTP requests by endpoint and status",
                                ("endpoint", "status"), registry=self.registry)
        self.prompt_tokens = Counter("tiderl_prompt_tokens", "prompt tokens of served choices", registry=self.registry)
        self.generated_tokens = Counter("tiderl_generation_tokens", "tokens generated", registry=self.registry)
        self.ttft = Histogram("tiderl_time_to_first_token_seconds", "time to first token", buckets=_LATENCY,
                              registry=self.registry)
        self.latency = Histogram("tiderl_e2e_request_latency_seconds", "choice latency", buckets=_LATENCY,
                                 registry=self.registry)
        self.frontend = None
        self.registry.register(self)

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def choice(self, prompt_tokens: int, generated: int, ttft_s: float | None, seconds: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.latency.observe(seconds)

    def collect(self):  # the live gauges, read at scrape time
        f = self.frontend
        if f is None:
            return
        yield GaugeMetricFamily("tiderl_requests_in_flight", "completions being served (prompts x n)", value=f.inflight)
        yield GaugeMetricFamily("tiderl_sessions", "live sessions", value=len(f.sessions))
        stats = f.service.stats()
        for name, doc in _REPLICA:
            g = GaugeMetricFamily(f"tiderl_replica_{name}", doc, labels=["replica"])
            for st in stats:
                g.add_metric([str(st["replica"])], float(st[name]))
            yield g

    def describe(self):
        return []

    def text(self) -> bytes:
        return generate_latest(self.registry)
