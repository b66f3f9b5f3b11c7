"""The gateway's Prometheus series: HTTP traffic by route and status, clients that went
away, and the usage ledger (tokens by tenant and model). Label values are bounded: routes
are the app's own, tenants come from the key file, models from the dependencies."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

REQUESTS = Counter(
    "aimesh_gateway_requests_total",
    "HTTP requests answered, by route and status code.",
    ["route", "status"],
)
LATENCY = Histogram(
    "aimesh_gateway_request_seconds",
    "Time from a request's arrival to its last byte (a whole stream), by route.",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
ABANDONED = Counter(
    "aimesh_gateway_client_disconnects_total",
    "Requests whose client went away (disconnect) or stopped reading (send_timeout); "
    "their mesh calls were cancelled.",
    ["route", "reason"],
)
TOKENS = Counter(
    "aimesh_gateway_tokens_total",
    "The usage ledger: tokens served, by tenant, model and kind (prompt, completion).",
    ["tenant", "model", "kind"],
)


USAGE_REQUESTS = Counter(
    "aimesh_gateway_usage_requests_total",
    "The usage ledger: requests served, by tenant and model.",
    ["tenant", "model"],
)
IMAGES = Counter(
    "aimesh_gateway_images_total",
    "The usage ledger: images generated, by tenant and model.",
    ["tenant", "model"],
)
LIMITED = Counter(
    "aimesh_gateway_limited_total",
    "Requests refused by a tenant's limit (requests_per_minute, tokens_per_minute, token_budget).",
    ["tenant", "limit"],
)


def record_usage(
    tenant: str, model: str, prompt_tokens: int, completion_tokens: int, images: int = 0
) -> None:
    USAGE_REQUESTS.labels(tenant, model).inc()
    TOKENS.labels(tenant, model, "prompt").inc(prompt_tokens)
    if completion_tokens:
        TOKENS.labels(tenant, model, "completion").inc(completion_tokens)
    if images:
        IMAGES.labels(tenant, model).inc(images)
