"""The server's Prometheus metrics (``GET /metrics``, ``prometheus-client``'s text format).

Each application has its own registry (two servers in one process do not share counts). Names follow vLLM's where
one exists, under the ``trickles_`` prefix:

* ``trickles_requests_total{outcome}``: requests ended, by outcome (``ok``, ``cancelled``, ``error``, ``rejected``);
* ``trickles_prompt_tokens_total``, ``trickles_generation_tokens_total``: tokens of finished requests;
* ``trickles_running_sequences``, ``trickles_waiting_sequences``: the scheduler's queues when scraped;
* ``trickles_kv_blocks_used``, ``trickles_kv_blocks_total``: the paged cache's blocks;
* ``trickles_prefix_cache_queries_total``, ``trickles_prefix_cache_hits_total``: prompt tokens of admitted sequences
  looked up in the prefix cache, and those found there (not prefilled), with prefix caching on;
* ``trickles_spec_decode_draft_tokens_total``, ``trickles_spec_decode_accepted_tokens_total``: with speculative
  decoding, tokens proposed and tokens of those the target accepted (:mod:`.speculative`);
* ``trickles_time_to_first_token_seconds``, ``trickles_inter_token_latency_seconds``: histograms, from a request's
  arrival to its first token and between consecutive tokens of a sequence.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ServingMetrics", "CONTENT_TYPE_LATEST"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServingMetrics:
    """The metrics of one engine: its hooks (``on_request``, ...) are called by the engine, the gauges read it."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter("trickles_requests", "Requests ended, by outcome.", ["outcome"], registry=r)
        self.prompt_tokens = Counter("trickles_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(
            "trickles_generation_tokens", "Tokens generated for finished requests.", registry=r
        )
        self.prefix_queries = Counter(
            "trickles_prefix_cache_queries", "Tokens of admitted sequences looked up in the prefix cache.", registry=r
        )
        self.prefix_hits = Counter(
            "trickles_prefix_cache_hits", "Tokens found in the prefix cache (not prefilled).", registry=r
        )
        self.spec_drafts = Counter(
            "trickles_spec_decode_draft_tokens", "Speculative decoding: tokens proposed.", registry=r
        )
        self.spec_accepted = Counter(
            "trickles_spec_decode_accepted_tokens", "Speculative decoding: proposed tokens accepted.", registry=r
        )
        self.running = Gauge("trickles_running_sequences", "Sequences admitted to the running batch.", registry=r)
        self.waiting = Gauge("trickles_waiting_sequences", "Sequences waiting for admission.", registry=r)
        self.blocks_used = Gauge("trickles_kv_blocks_used", "KV cache blocks held by sequences.", registry=r)
        self.blocks_total = Gauge("trickles_kv_blocks_total", "KV cache blocks in the pool.", registry=r)
        self.ttft = Histogram(
            "trickles_time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "trickles_inter_token_latency_seconds",
            "Between consecutive tokens of a sequence.",
            buckets=_LATENCY,
            registry=r,
        )

    def watch(self, engine) -> None:
        """Reads the queues and the pool of ``engine`` at every scrape."""
        self.running.set_function(lambda: len(engine.running))
        self.waiting.set_function(lambda: engine.backlog)
        self.blocks_used.set_function(lambda: engine.pool.used)
        self.blocks_total.set_function(lambda: engine.pool.num_blocks)

    def on_request(self, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()

    def on_tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)

    def on_prefix_cache(self, queried: int, hit: int) -> None:
        self.prefix_queries.inc(queried)
        self.prefix_hits.inc(hit)

    def on_spec_decode(self, drafted: int, accepted: int) -> None:
        self.spec_drafts.inc(drafted)
        self.spec_accepted.inc(accepted)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)
