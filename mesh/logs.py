"""Structured JSON logs, one object per line, each with trace_id, span_id and request_id.

The ids are what lets an operator jump from a log line to the trace of the request that
wrote it, and from a trace to every line of every service it touched.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

from opentelemetry import trace
from pythonjsonlogger.json import JsonFormatter

from mesh import request_id


class _CorrelationFilter(logging.Filter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        record.trace_id = format(context.trace_id, "032x") if context.is_valid else ""
        record.span_id = format(context.span_id, "016x") if context.is_valid else ""
        record.request_id = request_id.current()
        record.service = self.service
        return True


def configure(service: str, level: str | None = None, stream: TextIO | None = None) -> None:
    """Routes the root logger to stderr as JSON lines; AIMESH_LOG_LEVEL sets the level."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_CorrelationFilter(service))
    handler.setFormatter(
        JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s %(service)s %(trace_id)s "
            "%(span_id)s %(request_id)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level or os.environ.get("AIMESH_LOG_LEVEL", "INFO"))
