"""The automatic canary rollback rule on a stopped clock: what condemns a canary, what
does not (too few requests, a stable version as bad), and that old samples age out."""

from __future__ import annotations

import pytest

from services.generation.canary_rule import MAX_SAMPLES, CanaryRule, CanaryRuleSettings

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rule_on(clock: Clock, **settings) -> CanaryRule:
    return CanaryRule(CanaryRuleSettings(window_s=60, min_requests=10, **settings), clock)


def feed(rule: CanaryRule, version: str, ok: int, failed: int, ttft_s: float = 0.1) -> None:
    for _ in range(ok):
        rule.record("m", version, failed=False, ttft_s=ttft_s)
    for _ in range(failed):
        rule.record("m", version, failed=True, ttft_s=None)


def test_a_canary_failing_more_than_stable_is_condemned_for_its_errors():
    rule = rule_on(Clock())
    feed(rule, "stable", ok=50, failed=1)
    feed(rule, "canary", ok=6, failed=4)
    verdict = rule.verdict("m", "stable", "canary")
    assert verdict is not None and verdict.signal == "errors"
    assert "0.40 (4/10)" in verdict.reason


def test_too_few_requests_or_an_equally_bad_stable_condemn_nothing():
    rule = rule_on(Clock())
    feed(rule, "canary", ok=4, failed=5)  # 9 < min_requests
    assert rule.verdict("m", "stable", "canary") is None
    feed(rule, "canary", ok=0, failed=1)
    feed(rule, "stable", ok=5, failed=5)  # stable fails as often: not the canary's fault
    assert rule.verdict("m", "stable", "canary") is None
    assert rule_on(Clock(), enabled=False).verdict("m", "stable", "canary") is None


def test_a_canary_slow_to_its_first_token_is_condemned_for_ttft():
    rule = rule_on(Clock(), ttft_p99_factor=3.0)
    feed(rule, "stable", ok=20, failed=0, ttft_s=0.1)
    feed(rule, "canary", ok=20, failed=0, ttft_s=0.25)
    assert rule.verdict("m", "stable", "canary") is None  # 2.5x: within the factor
    feed(rule, "canary", ok=5, failed=0, ttft_s=2.0)
    verdict = rule.verdict("m", "stable", "canary")
    assert verdict is not None and verdict.signal == "ttft"


def test_samples_older_than_the_window_judge_nothing_and_memory_is_bounded():
    clock = Clock()
    rule = rule_on(clock)
    feed(rule, "canary", ok=0, failed=20)
    clock.now += 61
    assert rule.window("m", "canary").requests == 0
    assert rule.verdict("m", "stable", "canary") is None
    feed(rule, "canary", ok=MAX_SAMPLES + 5, failed=0)
    assert rule.window("m", "canary").requests == MAX_SAMPLES
    rule.forget("m", "canary")
    assert rule.window("m", "canary").requests == 0
