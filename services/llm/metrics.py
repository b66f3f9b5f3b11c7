"""LLM serving metrics, named after vLLM's (vllm:time_to_first_token_seconds and so on)
under the aimesh_llm_ prefix, so existing dashboards translate one to one."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

TIME_TO_FIRST_TOKEN = Histogram(
    "aimesh_llm_time_to_first_token_seconds",
    "From the request reaching the router to its first text delta.",
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "aimesh_llm_inter_token_latency_seconds",
    "Between consecutive generated tokens of one request, as the router sees them.",
    buckets=_LATENCY_BUCKETS,
)
E2E_REQUEST_LATENCY = Histogram(
    "aimesh_llm_e2e_request_latency_seconds",
    "From the request reaching the router to its final message.",
    buckets=_LATENCY_BUCKETS,
)
REQUEST_QUEUE_TIME = Histogram(
    "aimesh_llm_request_queue_time_seconds",
    "Time a decode request waited for a batch slot.",
    buckets=_LATENCY_BUCKETS,
)
NUM_REQUESTS_RUNNING = Gauge("aimesh_llm_num_requests_running", "Sequences in the decode batch.")
NUM_REQUESTS_WAITING = Gauge(
    "aimesh_llm_num_requests_waiting", "Sequences with pulled KV waiting for a batch slot."
)
KV_CACHE_USAGE = Gauge(
    "aimesh_llm_kv_cache_usage_perc", "Fraction of the decode KV cache in use, 0 to 1."
)
PREFILL_KV_LEASED_BYTES = Gauge(
    "aimesh_llm_prefill_kv_leased_bytes", "Bytes of KV held by prefill for decoders to pull."
)
# vLLM's prefix_cache_queries / prefix_cache_hits, in prompt tokens: hits / queries is the
# share of prompt tokens prefill did not compute.
PREFIX_CACHE_QUERIES = Counter(
    "aimesh_llm_prefix_cache_queries", "Prompt tokens prefill looked up in its prefix cache."
)
PREFIX_CACHE_HITS = Counter(
    "aimesh_llm_prefix_cache_hits", "Prompt tokens whose KV came from prefill's prefix cache."
)
PREFIX_CACHE_EVICTIONS = Counter(
    "aimesh_llm_prefix_cache_evictions", "Cached prompts evicted to make room for newer ones."
)
PREFIX_CACHE_BYTES = Gauge("aimesh_llm_prefix_cache_bytes", "Bytes of KV in the prefix cache.")

# Per model version (the registry's, mesh/deployments.py): what a canary is judged by.
# The labels are bounded by the versions an operator registered.
VERSION_TIME_TO_FIRST_TOKEN = Histogram(
    "aimesh_llm_version_time_to_first_token_seconds",
    "As aimesh_llm_time_to_first_token_seconds, by model and version.",
    ["model", "version"],
    buckets=_LATENCY_BUCKETS,
)
VERSION_INTER_TOKEN_LATENCY = Histogram(
    "aimesh_llm_version_inter_token_latency_seconds",
    "As aimesh_llm_inter_token_latency_seconds, by model and version.",
    ["model", "version"],
    buckets=_LATENCY_BUCKETS,
)
VERSION_REQUESTS = Counter(
    "aimesh_llm_version_requests_total",
    "Generations by model, version and outcome: a finish reason (stop, length, "
    "stop_sequence, ...) or error (the mesh failed it; refusals of bad input not counted).",
    ["model", "version", "outcome"],
)
VERSION_WARM_START = Histogram(
    "aimesh_llm_version_warm_start_seconds",
    "A version's warm start (the seed's warm_start_time): from a running router deciding "
    "to route to it to its being ready there: its workers answering with the registered "
    "artifact and one generation run (their own cold start is aimesh_cold_start_seconds).",
    ["model", "version"],
    buckets=_LATENCY_BUCKETS,
)
CANARY_ROLLBACKS = Counter(
    "aimesh_llm_canary_rollbacks_total",
    "Canaries the router's rule rolled back by itself, by model, version and signal.",
    ["model", "version", "signal"],
)
