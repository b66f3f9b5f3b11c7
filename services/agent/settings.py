"""The agent's settings ([services.agent] in the mesh config)."""

from __future__ import annotations

from pydantic import Field

from mesh.config import ServiceOptions


class AgentSettings(ServiceOptions):
    # The tools and generation the agent dials are its declared dependencies (services/
    # agent/__init__.py); a proxy on one edge goes in [services.agent.dependencies].
    # A run with no deadline of its own gets this one.
    default_budget_s: float = Field(default=60, gt=0)
    # Kept back from tool calls for the answer: this share of the budget, at least
    # answer_min_s, so the answer always has time left however the tools behave.
    answer_share: float = Field(default=0.4, gt=0, lt=1)
    answer_min_s: float = Field(default=2.0, gt=0)
    # Kept back from everything, to send the fallback answer, citations and Final after a
    # call below ran into the deadline.
    wrap_up_s: float = Field(default=0.2, ge=0)
    # SmolLM2-135M loops on greedy decoding, so answers are kept short (RunOptions.
    # max_new_tokens raises the limit). No repetition penalty by default: it counts the
    # prompt too, and so pushes the model away from copying the evidence (at 1.1 it
    # answered "(17*23)+4" with 68 although the prompt said 395).
    max_new_tokens: int = Field(default=160, ge=1)
    # Each round's plan (the model's tool calls) gets at most this long before the rules
    # plan instead.
    plan_timeout_s: float = Field(default=5.0, gt=0)
    repetition_penalty: float = Field(default=1.0, ge=1)
    passages_in_prompt: int = Field(default=4, ge=1, le=20)
    # Where runs and their events are kept (services/agent/run_store.py), shared by the
    # replicas that may take over each other's runs: "" (<cache_dir>/agent-runs.sqlite3)
    # or a file path for replicas on one machine, a Redis URL for several.
    run_store: str = ""
    # Ended runs are kept this long for Attach and GetRun, then pruned.
    run_retention_s: float = Field(default=86_400, gt=0)
    # Runs in progress in this process, background ones included; more is RESOURCE_EXHAUSTED.
    max_live_runs: int = Field(default=64, ge=1)
    # How often Attach and Cancel look at the store for a run another replica runs.
    attach_poll_s: float = Field(default=0.2, gt=0)
    # A replica holds each of its runs this long per renewal (it renews four times per
    # lease); a run whose replica died is taken over by another this long after.
    lease_s: float = Field(default=10.0, gt=0)
    # A session's earlier turns in the answer prompt: the newest that fit in this many
    # characters of questions and answers (the small model's context is 2048 tokens).
    history_chars: int = Field(default=2000, ge=0)
    # Model tiers: the model that picks the tool and the one that writes the answer, by
    # name (a model the generation router serves: its registry picks the version);
    # "": the mesh's own model.
    plan_model: str = ""
    answer_model: str = ""
