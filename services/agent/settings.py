"""The agent's settings ([services.agent] in the mesh config)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, model_validator

from mesh.config import ServiceOptions


class McpServerSettings(BaseModel):
    """One MCP server the agent mounts ([[services.agent.mcp_servers]]): over Streamable
    HTTP (`url`, its bearer key read from `key_file`, a mounted Secret in Kubernetes)
    or over stdio (`command`, started by the agent and kept running). Its tools join the
    run's catalogue as `<name>__<tool>`, the allowed ones only when `allowed_tools`
    names some."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,15}$")
    url: str = ""
    key_file: Path | None = None
    command: list[str] = Field(default_factory=list)
    # Added to the agent's own environment for a stdio server.
    env: dict[str, str] = Field(default_factory=dict)
    # The protocol revision: "auto" (2026-07-28 where the server speaks it, else the
    # 2025-11-25 handshake), "legacy" (the handshake only) or a revision to insist on.
    protocol: str = Field(default="auto", pattern=r"^(auto|legacy|\d{4}-\d{2}-\d{2})$")
    # The tools the agent may call, by the server's names; empty: every tool it lists.
    allowed_tools: list[str] = Field(default_factory=list)
    # One call's limit (the run's budget may cut it shorter), calls in flight at once,
    # and the largest result taken (text and structured content, as JSON): more is the
    # call's error, not the run's.
    call_timeout_s: float = Field(default=30.0, gt=0)
    max_concurrency: int = Field(default=4, ge=1)
    max_result_bytes: int = Field(default=1024 * 1024, ge=1024)

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerSettings:
        if bool(self.url) == bool(self.command):
            raise ValueError(f"mcp server {self.name!r}: give either url or command")
        if self.key_file is not None and not self.url:
            raise ValueError(f"mcp server {self.name!r}: key_file is for a url")
        return self


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
    # MCP servers whose tools the agent may call beside the tools service's
    # (services/agent/mcp_mounts.py).
    mcp_servers: list[McpServerSettings] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_servers(self) -> AgentSettings:
        names = [server.name for server in self.mcp_servers]
        if len(set(names)) != len(names):
            raise ValueError(f"mcp_servers: names must be unique, got {names}")
        return self
