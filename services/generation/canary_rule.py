"""The automatic rollback rule: a canary that fails more, or answers slower, than the
stable version over the same recent window is rolled back without waiting for a person.

Each router judges what it saw itself (its own requests, by model and version), so the
rule needs no shared metrics store; the rollback it makes goes through the registry
(`end_canary`, which only ends the canary it judged), so every replica follows it and
the audit trail names the rule and its numbers.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, Field

# Per version: the most samples a window keeps, whatever its length (bounded memory at
# any request rate; at 10,000 the p99 is still made of 100 samples).
MAX_SAMPLES = 10_000


class CanaryRuleSettings(BaseModel, extra="forbid"):
    """[services.generation.canary_rule]."""

    enabled: bool = True
    window_s: float = Field(default=60.0, gt=0)
    # Neither version is judged on fewer requests in the window.
    min_requests: int = Field(default=10, ge=1)
    # Errors: the canary's rate must exceed both this floor and factor x stable's rate.
    min_error_rate: float = Field(default=0.05, ge=0, le=1)
    error_factor: float = Field(default=2.0, ge=1)
    # Time to first token: the canary's p99 over factor x stable's p99.
    ttft_p99_factor: float = Field(default=3.0, ge=1)


@dataclass(frozen=True)
class _Sample:
    at: float
    failed: bool
    ttft_s: float | None


@dataclass(frozen=True)
class Window:
    requests: int
    errors: int
    ttft_p99_s: float | None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class Verdict:
    signal: str  # "errors" or "ttft"
    reason: str


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


class CanaryRule:
    def __init__(
        self, settings: CanaryRuleSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._samples: dict[tuple[str, str], deque[_Sample]] = {}

    def record(self, model: str, version: str, *, failed: bool, ttft_s: float | None) -> None:
        samples = self._samples.setdefault((model, version), deque(maxlen=MAX_SAMPLES))
        samples.append(_Sample(self.clock(), failed, ttft_s))

    def forget(self, model: str, version: str) -> None:
        """Drops a version's window: after a rollback its old samples judge nothing."""
        self._samples.pop((model, version), None)

    def window(self, model: str, version: str) -> Window:
        samples = self._samples.get((model, version), deque())
        horizon = self.clock() - self.settings.window_s
        while samples and samples[0].at < horizon:
            samples.popleft()
        return Window(
            requests=len(samples),
            errors=sum(s.failed for s in samples),
            ttft_p99_s=_p99([s.ttft_s for s in samples if s.ttft_s is not None]),
        )

    def verdict(self, model: str, stable: str, canary: str) -> Verdict | None:
        """Why the canary must roll back now; None while it holds up (or too few
        requests say either way)."""
        rule = self.settings
        if not rule.enabled:
            return None
        ours, theirs = self.window(model, canary), self.window(model, stable)
        if ours.requests < rule.min_requests:
            return None
        if (
            ours.error_rate > rule.min_error_rate
            and ours.error_rate > rule.error_factor * theirs.error_rate
        ):
            return Verdict(
                "errors",
                f"canary error rate {ours.error_rate:.2f} ({ours.errors}/{ours.requests}) over "
                f"{rule.error_factor:g} x stable's {theirs.error_rate:.2f} in {rule.window_s:g} s",
            )
        if (
            theirs.requests >= rule.min_requests
            and ours.ttft_p99_s is not None
            and theirs.ttft_p99_s is not None
            and ours.ttft_p99_s > rule.ttft_p99_factor * theirs.ttft_p99_s
        ):
            return Verdict(
                "ttft",
                f"canary TTFT p99 {ours.ttft_p99_s * 1000:.0f} ms over "
                f"{rule.ttft_p99_factor:g} x stable's {theirs.ttft_p99_s * 1000:.0f} ms "
                f"in {rule.window_s:g} s",
            )
        return None
