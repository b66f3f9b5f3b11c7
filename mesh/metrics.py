"""Prometheus metrics for every RPC a server handles, and the per-process exposition.

Names follow aimesh_<subsystem>_<name>_<unit>. Label values are bounded: service and
method come from the server's own registered handlers, code from grpc.StatusCode.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import psutil
from prometheus_client import (
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from mesh.rpc import split_method

# The *_created series double every counter's cardinality and no dashboard reads them.
disable_created_metrics()

HANDLED = Counter(
    "aimesh_rpc_server_handled_total",
    "RPCs completed on the server, by method and status code.",
    ["grpc_service", "grpc_method", "grpc_code"],
)
HANDLING = Histogram(
    "aimesh_rpc_server_handling_seconds",
    "Time from the start of an RPC to its status, queueing included.",
    ["grpc_service", "grpc_method"],
    buckets=(
        0.0005,
        0.001,
        0.0025,
        0.005,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        0.5,
        1,
        2.5,
        5,
        10,
        30,
        60,
        120,
        300,
    ),
)
IN_FLIGHT = Gauge(
    "aimesh_rpc_server_in_flight",
    "RPCs currently being handled.",
    ["grpc_service", "grpc_method"],
)
MESSAGES_SENT = Counter(
    "aimesh_rpc_server_msg_sent_total",
    "Messages sent on server-streaming RPCs.",
    ["grpc_service", "grpc_method"],
)


def _code_of(context: grpc.aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    if isinstance(exc, asyncio.CancelledError):
        left = context.time_remaining()
        expired = left is not None and left <= 0
        return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if exc is not None and not isinstance(exc, grpc.aio.AbortError):
        return grpc.StatusCode.UNKNOWN
    return grpc.StatusCode.OK


class MethodMetrics:
    """One method's series, with label children resolved once, not once per call."""

    def __init__(self, full_method: str) -> None:
        self.service, self.method = split_method(full_method)
        self.handling = HANDLING.labels(self.service, self.method)
        self.in_flight = IN_FLIGHT.labels(self.service, self.method)
        self.sent = MESSAGES_SENT.labels(self.service, self.method)
        self._handled: dict[grpc.StatusCode, Any] = {}

    def started(self) -> float:
        self.in_flight.inc()
        return time.perf_counter()

    def finished(
        self, context: grpc.aio.ServicerContext, exc: BaseException | None, started: float
    ) -> None:
        self.in_flight.dec()
        self.handling.observe(time.perf_counter() - started)
        code = _code_of(context, exc)
        handled = self._handled.get(code)
        if handled is None:
            handled = self._handled[code] = HANDLED.labels(self.service, self.method, code.name)
        handled.inc()


ASYNCIO_TASKS = Gauge(
    "aimesh_runtime_asyncio_tasks",
    "Live asyncio tasks in the server's event loop; flat when idle, or something leaks.",
)


COLD_START = Gauge(
    "aimesh_cold_start_seconds",
    "Seconds from this process's start to its server's readiness, every warm-up (a model's "
    "first forward) included: the seed's cold_start_time.",
)


def record_cold_start() -> float:
    """Sets COLD_START from the process's start time (the OS's, so imports count)."""
    took = time.time() - psutil.Process().create_time()
    COLD_START.set(took)
    return took


def watch_event_loop(loop: asyncio.AbstractEventLoop) -> None:
    ASYNCIO_TASKS.set_function(lambda: len(asyncio.all_tasks(loop)))


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Exposes this process's registry on http://host:port/metrics (a daemon thread)."""
    start_http_server(port, addr=host)
