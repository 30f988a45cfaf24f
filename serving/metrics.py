"""Prometheus metrics of the server: request latencies (TTFT, TPOT, E2E), queue depths, KV-page usage and
token counts, in a registry of their own (so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The series `/metrics` exposes (names prefixed `jaxseek:`, as vLLM prefixes `vllm:`)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": self.registry}
        self.ttft = Histogram("jaxseek:time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=LATENCY_BUCKETS, **label).labels(model_name)
        self.tpot = Histogram("jaxseek:time_per_output_token_seconds",
                              "Per request: (E2E - TTFT) / (output tokens - 1).", buckets=PER_TOKEN_BUCKETS,
                              **label).labels(model_name)
        self.e2e = Histogram("jaxseek:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=LATENCY_BUCKETS, **label).labels(model_name)
        self.running = Gauge("jaxseek:num_requests_running", "Requests holding a slot.", **label).labels(model_name)
        self.waiting = Gauge("jaxseek:num_requests_waiting", "Requests queued or preempted.",
                             **label).labels(model_name)
        self.kv_usage = Gauge("jaxseek:kv_cache_usage_perc", "Fraction of compressed-KV pages in use.",
                              **label).labels(model_name)
        self.prompt_tokens = Counter("jaxseek:prompt_tokens", "Prompt tokens of finished requests.",
                                     **label).labels(model_name)
        self.generation_tokens = Counter("jaxseek:generation_tokens", "Generated tokens of finished requests.",
                                         **label).labels(model_name)
        self.preemptions = Counter("jaxseek:num_preemptions", "Preemptions of finished requests.",
                                   **label).labels(model_name)
        self.finished = Counter("jaxseek:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.rejected = Counter("jaxseek:request_rejected", "Requests answered with a 4xx status, by status.",
                                ["model_name", "status"], registry=self.registry)
        self.model_name = model_name

    def observe_engine(self, running: int, waiting: int, pages_used: int, pages_total: int) -> None:
        """Queue depths and KV usage after an engine step."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(pages_used / max(pages_total, 1))

    def observe_finished(self, output) -> None:
        """A finished request's latencies and tokens (a `serving.request.RequestOutput`)."""
        self.finished.labels(self.model_name, output.finish_reason).inc()
        self.prompt_tokens.inc(len(output.prompt_ids))
        self.generation_tokens.inc(len(output.token_ids))
        self.preemptions.inc(output.preemptions)
        self.e2e.observe(output.latency)
        if output.time_to_first_token is not None:
            self.ttft.observe(output.time_to_first_token)
            if len(output.token_ids) > 1:
                self.tpot.observe((output.latency - output.time_to_first_token) / (len(output.token_ids) - 1))

    def observe_rejected(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
