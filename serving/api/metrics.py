"""Prometheus metrics of the server: request latencies (TTFT, TPOT, E2E), queue depths, KV-page usage, token
counts, the time to add a constrained request (its grammar's compilation), the host time spent filling token
masks of constrained requests, the expert shards' balance of a data-parallel engine with experts over `ep` and,
under speculative decoding,
drafts verified and accepted (per block position), in a registry of their own (so several servers can live in
one process)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
COMPILE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    """The series `/metrics` exposes (names prefixed `jaxseek:`, as vLLM prefixes `vllm:`)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, num_drafts: int = 0):
        """`num_drafts`: the engine's most drafts per step (0: no speculation, no spec-decode series)."""
        if num_drafts < 0:
            raise ValueError(f"num_drafts must be >= 0, got {num_drafts}")
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
        self.prefix_hit_rate = Gauge("jaxseek:prefix_cache_hit_rate", "Prompt tokens served from the prefix "
                                     "cache over prompt tokens admitted.", **label).labels(model_name)
        self._rank_hit_rate = Gauge("jaxseek:prefix_cache_hit_rate_by_rank", "Prompt tokens served from the prefix "
                                    "cache of one attention rank over prompt tokens admitted there (a mesh "
                                    "engine).", ["model_name", "rank"], registry=self.registry)
        self.prefix_queries = Counter("jaxseek:prefix_cache_queries", "Prompt tokens admitted with the prefix cache "
                                      "on (vLLM's prefix_cache_queries).", **label).labels(model_name)
        self.prefix_hits = Counter("jaxseek:prefix_cache_hits", "Of those, tokens the prefix cache held (vLLM's "
                                   "prefix_cache_hits).", **label).labels(model_name)
        self._prefix_seen = {"query_tokens": 0, "hit_tokens": 0}
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
        self.constraint_setup = Histogram("jaxseek:constraint_setup_seconds", "Engine time to add a constrained "
                                          "request: its grammar compiled, or found compiled (refusals included).",
                                          buckets=COMPILE_BUCKETS, **label).labels(model_name)
        self.grammar_mask = Counter("jaxseek:grammar_mask_seconds", "Host time filling the token masks of "
                                    "constrained requests (mostly while the device runs the step's forward).",
                                    **label).labels(model_name)
        self.grammar_exposed = Counter("jaxseek:grammar_mask_exposed_seconds", "Grammar work (filling masks, "
                                       "advancing matchers) the device may have waited for; an upper bound.",
                                       **label).labels(model_name)
        self._grammar_seen = {"grammar_seconds": 0.0, "grammar_exposed_seconds": 0.0}
        self._balance = Gauge("jaxseek:eplb_balancedness", "Mean over max (token, expert) pairs per expert shard "
                              "under the current EPLB placement, summed over MoE layers (1: balanced).", **label)
        self.eplb_balancedness = None  # labelled on the first value: engines without expert shards export none
        self.model_name = model_name
        self.num_drafts = num_drafts
        if num_drafts:
            self._spec_series(label)
        self._seen = {"decode_rows": 0, "verified": 0, "accepted": 0, "accepted_at": [0] * num_drafts}

    def _spec_series(self, label: dict) -> None:
        name = self.model_name
        self.spec_steps = Counter("jaxseek:spec_decode_num_drafts", "Decode / verify rows run (one per request "
                                  "per step).", **label).labels(name)
        self.spec_verified = Counter("jaxseek:spec_decode_num_draft_tokens", "Draft tokens verified.",
                                     **label).labels(name)
        self.spec_accepted = Counter("jaxseek:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                     **label).labels(name)
        per_pos = Counter("jaxseek:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position "
                          "in the drafted block (0: the first draft).", ["model_name", "position"],
                          registry=self.registry)
        self.spec_accepted_at = [per_pos.labels(name, str(i)) for i in range(self.num_drafts)]
        self.spec_tokens_per_step = Gauge("jaxseek:spec_decode_tokens_per_step", "Tokens emitted per decode / "
                                          "verify row since start (1 + accepted drafts).", **label).labels(name)
        self.spec_acceptance = Gauge("jaxseek:spec_decode_acceptance_rate", "Accepted / verified draft tokens "
                                     "since start.", **label).labels(name)

    def observe_engine(self, running: int, waiting: int, pages_used: int, pages_total: int) -> None:
        """Queue depths and KV usage after an engine step."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(pages_used / max(pages_total, 1))

    def observe_grammar(self, stats: dict) -> None:
        """The engine's cumulative mask-filling and exposed grammar time (`Engine.stats["grammar_seconds"]`,
        `["grammar_exposed_seconds"]`) after a step."""
        for counter, key in ((self.grammar_mask, "grammar_seconds"), (self.grammar_exposed, "grammar_exposed_seconds")):
            _advance(counter, self._grammar_seen, key, stats[key])

    def observe_eplb(self, stats: dict) -> None:
        """The engine's expert-shard balancedness (`Engine.stats["eplb_balancedness"]`, present once a step of a
        mesh with ep > 1 has been counted)."""
        if "eplb_balancedness" in stats:
            if self.eplb_balancedness is None:
                self.eplb_balancedness = self._balance.labels(self.model_name)
            self.eplb_balancedness.set(stats["eplb_balancedness"])

    def observe_prefix(self, metrics: dict[str, float]) -> None:
        """The prefix cache's hit rate and token counts (`Engine.prefix_cache_metrics`, cumulative: empty when
        the cache is off) and, on a mesh, each attention rank's hit rate (`rank{d}_hit_rate`)."""
        self.prefix_hit_rate.set(metrics.get("hit_rate", 0.0))
        for counter, key in ((self.prefix_queries, "query_tokens"), (self.prefix_hits, "hit_tokens")):
            _advance(counter, self._prefix_seen, key, metrics.get(key, 0))
        for key, value in metrics.items():
            if key.startswith("rank") and key.endswith("_hit_rate"):
                self._rank_hit_rate.labels(self.model_name, key[len("rank"):-len("_hit_rate")]).set(value)

    def observe_speculation(self, stats: dict) -> None:
        """The engine's cumulative speculation counts (`Engine.stats`: decode_rows, verified, accepted,
        accepted_at) after a step; counters advance by what changed since the last call."""
        if not self.num_drafts:
            return
        seen = self._seen
        for key, counter in (("decode_rows", self.spec_steps), ("verified", self.spec_verified),
                             ("accepted", self.spec_accepted)):
            counter.inc(int(stats[key]) - seen[key])
            seen[key] = int(stats[key])
        for i, counter in enumerate(self.spec_accepted_at):
            now = int(stats["accepted_at"][i])
            counter.inc(now - seen["accepted_at"][i])
            seen["accepted_at"][i] = now
        rows = max(seen["decode_rows"], 1)
        self.spec_tokens_per_step.set((seen["accepted"] + seen["decode_rows"]) / rows)
        self.spec_acceptance.set(seen["accepted"] / max(seen["verified"], 1))

    def observe_finished(self, output) -> None:
        """A finished request's latencies and tokens (a `serving.base.request.RequestOutput`)."""
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


def _advance(counter: Counter, seen: dict, key: str, total: float) -> None:
    """Advance `counter` by how much the engine's cumulative `total` under `key` grew since `seen[key]`."""
    counter.inc(max(total - seen[key], 0))
    seen[key] = total
