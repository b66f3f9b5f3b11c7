"""The periods a tenant's token budget renews over: UTC calendar days or months, or
never. Every process that meters (each gateway and router replica) derives the same
period from its wall clock, so a budget spent through one is spent on all of them (the
store keys it by period)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

Period = Literal["lifetime", "day", "month"]


@dataclass(frozen=True)
class Span:
    """One period: its label (part of the store's key) and when it ends (None: never)."""

    label: str
    ends: datetime | None

    def seconds_left(self, now: datetime) -> float | None:
        return None if self.ends is None else max(0.0, (self.ends - now).total_seconds())


def current(period: Period, now: datetime) -> Span:
    """The period `now` (timezone-aware) lies in."""
    now = now.astimezone(UTC)
    if period == "day":
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        return Span(start.strftime("%Y-%m-%d"), start + timedelta(days=1))
    if period == "month":
        start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        ends = start.replace(year=start.year + start.month // 12, month=start.month % 12 + 1)
        return Span(start.strftime("%Y-%m"), ends)
    return Span("", None)
