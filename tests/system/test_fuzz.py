"""The fuzzer's short run against the whole mesh: generated and garbage requests on every
RPC of every service must never be answered INTERNAL/UNKNOWN, fail a health check or end
a process (`make fuzz` is the long run)."""

from __future__ import annotations

import pytest

from loadtest.fuzz import fuzz

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="package")]


async def test_generated_requests_break_nothing(mesh):
    targets = {name: mesh.target(name) for name in mesh.ports}
    report = await fuzz(targets, calls=400, seconds=40, seed=16, deadline_s=2.0)
    assert all(sum(codes.values()) for codes in report.codes.values()), "an RPC got no calls"
    assert {rpc.service for rpc in report.codes} == set(targets)
    assert not report.findings, "\n".join(finding.describe() for finding in report.findings)
    assert not report.health_failures, report.health_failures
    assert not report.crashes, report.crashes
