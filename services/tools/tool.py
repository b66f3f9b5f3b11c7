"""What a tool is to the tools service: its description, its limits, and its body.

A tool's body is an async generator: it yields Progress as it goes and ToolOutput once at
the end. A failure the model should read (nothing found, a backend down, bad arithmetic)
is raised as ToolError and becomes a result with is_error; anything else is a bug.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from aimesh.tools.v1 import tools_pb2
from services.tools.settings import ToolsSettings


class ToolError(Exception):
    """The tool could not do what was asked; the message is written for the model."""


@dataclass(frozen=True)
class ToolOutput:
    text: str
    structured: dict[str, Any] | None = None
    images: list[tuple[bytes, str]] = field(default_factory=list)  # (data, mime type)


@dataclass(frozen=True)
class ToolContext:
    """What a tool body may use: the settings, and mesh channels (deadline, breaker,
    retries) to the services the tools service declares, by name: MeshServer.channel_to."""

    settings: ToolsSettings
    channel: Callable[[str, ServiceDescriptor], grpc.aio.Channel]


ToolEvent = tools_pb2.Progress | ToolOutput
ToolBody = Callable[[dict[str, Any], ToolContext], AsyncIterator[ToolEvent]]


@dataclass(frozen=True)
class ToolDefinition:
    name: str
    title: str
    description: str
    input_schema: dict[str, Any]
    output_schema: dict[str, Any] | None
    annotations: tools_pb2.ToolAnnotations
    body: ToolBody
    # The call fails (is_error) when no Progress or result comes for idle_timeout_s, or
    # when it has run timeout_s in all, whatever its progress.
    timeout_s: float
    idle_timeout_s: float

    def limits(self, settings: ToolsSettings) -> tuple[float, float]:
        """(time limit, idle limit) after the settings' overrides and cap."""
        limit = min(settings.timeout_s.get(self.name, self.timeout_s), settings.max_call_s)
        return limit, min(settings.idle_timeout_s.get(self.name, self.idle_timeout_s), limit)
