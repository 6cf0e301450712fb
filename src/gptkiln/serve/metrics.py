"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own per app."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 (re-exported)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ROUTES = (
    "/",
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/inspect",
    "/v1/tokenize",
    "/v1/chat/completions",
)

# Seconds: from a few milliseconds (a tiny model's step) to a minute (a long queue on a CPU).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServeMetrics:
    """Requests by route and status, tokens, queue length, busy slots, and the latency of the
    first token and of each later one.

    Args:
        waiting: returns how many sequences wait for a slot (read at each scrape).
        active: returns how many slots are decoding.
    """

    def __init__(self, waiting, active) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "gptkiln_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "gptkiln_prompt_tokens", "Prompt tokens of accepted requests", registry=r
        )
        self.generated_tokens = Counter("gptkiln_generated_tokens", "Tokens generated", registry=r)
        self.queue_length = Gauge(
            "gptkiln_queue_length", "Sequences waiting for a slot", registry=r
        )
        self.queue_length.set_function(waiting)
        self.active_slots = Gauge(
            "gptkiln_active_slots", "Slots (KV-cache rows) decoding a sequence", registry=r
        )
        self.active_slots.set_function(active)
        self.time_to_first_token = Histogram(
            "gptkiln_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "gptkiln_inter_token_latency_seconds",
            "Between two tokens of one sequence",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def token(self, first: bool, seconds: float) -> None:
        """A token was handed to its request, ``seconds`` after the previous one (or after the
        request arrived, for the first)."""
        self.generated_tokens.inc()
        (self.time_to_first_token if first else self.inter_token_latency).observe(seconds)

    def answered(self, path: str, status: int) -> None:
        route = (
            path
            if path in ROUTES
            else "/v1/models/{id}"
            if path.startswith("/v1/models/")
            else "other"
        )
        self.requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
