"""The gateway's Prometheus series: HTTP traffic by route and status, and clients that
went away. Label values are bounded: routes are the app's own. (The usage ledger's
counters, by tenant and model, are the meter's: mesh/metering.py.)"""

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
