"""The agent's Prometheus series: runs by how they ended and why, runs taken over from a
replica that died, and what checkpointing costs. Label values are bounded: states are
the RunState enum, reasons the loop's few shortfall words."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

RUNS = Counter(
    "aimesh_agent_runs_total",
    "Runs ended, by terminal state (answered, partial, failed, cancelled, handed_off) and "
    "reason (the first shortfall of a partial run, the hand-off's, invalid_input or error "
    "for a failed one; empty otherwise).",
    ["state", "reason"],
)
RESUMED = Counter(
    "aimesh_agent_runs_resumed_total",
    "Runs this replica took over from a replica that stopped renewing their lease.",
)
CHECKPOINT_BYTES = Histogram(
    "aimesh_agent_checkpoint_bytes",
    "Size of a run's checkpoint (compressed), written after each plan and tool result.",
    buckets=(256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072),
)
