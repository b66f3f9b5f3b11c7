"""Per-target circuit breaking for grpc.aio channels, unary and streaming.

Written here rather than taken from a library because none fits: pybreaker and
aiobreaker count exceptions in a synchronous or decorator world, while aimesh needs a
breaker that sits in a grpc.aio client interceptor, classifies gRPC status codes (an
INVALID_ARGUMENT is the caller's fault, a DEADLINE_EXCEEDED only counts when the budget was
sane), covers streams, and treats RESOURCE_EXHAUSTED + RetryInfo as backpressure to honour
rather than a failure. The state machine follows resilience4j: a count-based sliding
window of failure and slow-call rates, CLOSED -> OPEN -> HALF_OPEN -> CLOSED.

One breaker per target is shared by every caller in the process, so it counts only what
says the target itself is unwell (unreachable, not ready, too slow). INTERNAL and UNKNOWN
are a live target's answer to one request (a bug its content set off) and count for no
one else; nor does a refusal that names the caller's own deadline as the reason, nor a
failure the target passed up from its own dependency (that hop's breaker holds it back;
counting it here too would keep this path closed for open_wait_s after the dependency
recovered).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable

import grpc
from prometheus_client import Counter, Gauge

from mesh.config import BreakerSettings
from mesh.errors import error_info, passed_through, retry_delay_s, status
from mesh.failures import QUOTA_REASONS


class State(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class Outcome(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    IGNORED = "ignored"


FAILURE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})
# RESOURCE_EXHAUSTED reasons that are about one call or one tenant, not the target's
# capacity: holding every caller back for them would let one caller's short deadline, or
# one tenant's spent quota, stall the rest.
CALLER_REASONS = frozenset({"DEADLINE_TOO_SHORT", *QUOTA_REASONS})

STATE = Gauge(
    "aimesh_breaker_state",
    "Circuit breaker state per target: 0 closed, 1 open, 2 half-open.",
    ["target"],
)
TRANSITIONS = Counter(
    "aimesh_breaker_transitions_total", "Circuit breaker state changes.", ["target", "to"]
)
REJECTED = Counter(
    "aimesh_breaker_rejected_total",
    "Calls failed locally by the breaker, by reason (open, backpressure).",
    ["target", "reason"],
)


def classify(
    code: grpc.StatusCode,
    timeout_s: float | None,
    settings: BreakerSettings,
    *,
    streaming: bool = False,
) -> Outcome:
    """A missed deadline counts for a unary call with a sane budget (the target was slow);
    never for a stream, whose length is the caller's to choose: a generation asked for
    more tokens than its budget allows is that caller's, not decode's, failure."""
    if code == grpc.StatusCode.OK:
        return Outcome.SUCCESS
    if code in FAILURE_CODES:
        return Outcome.FAILURE
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and not streaming:
        sane = timeout_s is None or timeout_s >= settings.sane_deadline_s
        return Outcome.FAILURE if sane else Outcome.IGNORED
    return Outcome.IGNORED


class CircuitBreaker:
    """The state machine; `before_call()` admits or refuses, `record()` feeds the window."""

    def __init__(
        self,
        target: str,
        settings: BreakerSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target = target
        self.settings = settings or BreakerSettings()
        self._clock = clock
        self._state = State.CLOSED
        self._window: deque[tuple[bool, bool]] = deque(maxlen=self.settings.window_size)
        self._opened_at = 0.0
        self._trials_started = 0
        self._trials: list[tuple[bool, bool]] = []
        self._pushback_until = 0.0
        STATE.labels(target).set(State.CLOSED)

    @property
    def state(self) -> State:
        if (
            self._state is State.OPEN
            and self._clock() - self._opened_at >= self.settings.open_wait_s
        ):
            self._transition(State.HALF_OPEN)
        return self._state

    def before_call(self, method: str) -> grpc.Status | None:
        """None to let the call through, or the status to fail it with locally."""
        state = self.state
        if state is State.OPEN:
            REJECTED.labels(self.target, "open").inc()
            wait = self.settings.open_wait_s - (self._clock() - self._opened_at)
            return status(
                grpc.StatusCode.UNAVAILABLE,
                f"circuit breaker for {self.target} is open",
                reason="CIRCUIT_OPEN",
                metadata={"target": self.target, "method": method},
                retry_after_s=max(wait, 0.0),
            )
        pushback = self._pushback_until - self._clock()
        if pushback > 0:
            REJECTED.labels(self.target, "backpressure").inc()
            return status(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.target} asked callers to back off",
                reason="BACKPRESSURE",
                metadata={"target": self.target, "method": method},
                retry_after_s=pushback,
            )
        if state is State.HALF_OPEN:
            if self._trials_started >= self.settings.half_open_calls:
                REJECTED.labels(self.target, "open").inc()
                return status(
                    grpc.StatusCode.UNAVAILABLE,
                    f"circuit breaker for {self.target} is half-open and its trial calls are busy",
                    reason="CIRCUIT_OPEN",
                    metadata={"target": self.target, "method": method},
                    retry_after_s=self.settings.open_wait_s,
                )
            self._trials_started += 1
        return None

    def record(self, outcome: Outcome, duration_s: float, *, streaming: bool = False) -> None:
        """Feeds one finished call; streams are never "slow" (a long stream is normal)."""
        slow = not streaming and duration_s >= self.settings.slow_call_s
        if self._state is State.HALF_OPEN:
            if outcome is Outcome.IGNORED:
                self._trials_started = max(self._trials_started - 1, 0)
                return
            self._trials.append((outcome is Outcome.FAILURE, slow))
            if len(self._trials) >= self.settings.half_open_calls:
                self._transition(State.OPEN if self._tripped(self._trials) else State.CLOSED)
            return
        if self._state is State.OPEN or outcome is Outcome.IGNORED:
            return
        self._window.append((outcome is Outcome.FAILURE, slow))
        if len(self._window) >= self.settings.minimum_calls and self._tripped(self._window):
            self._transition(State.OPEN)

    def record_status(
        self,
        code: grpc.StatusCode,
        error: grpc.aio.AioRpcError | None,
        duration_s: float,
        timeout_s: float | None,
        *,
        streaming: bool,
    ) -> None:
        """Feeds a finished call by its status; RESOURCE_EXHAUSTED + RetryInfo holds calls."""
        if error is not None and passed_through(error):
            outcome = Outcome.IGNORED
        else:
            outcome = classify(code, timeout_s, self.settings, streaming=streaming)
        self.record(outcome, duration_s, streaming=streaming)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and error is not None:
            info = error_info(error)
            delay = retry_delay_s(error)
            if delay and (info is None or info.reason not in CALLER_REASONS):
                self.push_back(delay)

    def push_back(self, delay_s: float) -> None:
        """The target answered RESOURCE_EXHAUSTED with RetryInfo: hold calls for that long."""
        self._pushback_until = max(self._pushback_until, self._clock() + delay_s)

    def _tripped(self, calls: deque[tuple[bool, bool]] | list[tuple[bool, bool]]) -> bool:
        failures = sum(failed for failed, _ in calls) / len(calls)
        slow = sum(was_slow for _, was_slow in calls) / len(calls)
        return failures >= self.settings.failure_rate or slow >= self.settings.slow_call_rate

    def _transition(self, to: State) -> None:
        self._state = to
        self._window.clear()
        self._trials = []
        self._trials_started = 0
        if to is State.OPEN:
            self._opened_at = self._clock()
        STATE.labels(self.target).set(to)
        TRANSITIONS.labels(self.target, to.name.lower()).inc()
