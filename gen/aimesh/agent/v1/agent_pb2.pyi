from aimesh.common.v1 import common_pb2 as _common_pb2
from google.api import annotations_pb2 as _annotations_pb2
from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_ANSWERED: _ClassVar[RunState]
    RUN_STATE_PARTIAL: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
    RUN_STATE_CANCELLED: _ClassVar[RunState]
    RUN_STATE_HANDED_OFF: _ClassVar[RunState]

class Planner(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLANNER_UNSPECIFIED: _ClassVar[Planner]
    PLANNER_LLM: _ClassVar[Planner]
    PLANNER_FALLBACK: _ClassVar[Planner]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_ANSWERED: RunState
RUN_STATE_PARTIAL: RunState
RUN_STATE_FAILED: RunState
RUN_STATE_CANCELLED: RunState
RUN_STATE_HANDED_OFF: RunState
PLANNER_UNSPECIFIED: Planner
PLANNER_LLM: Planner
PLANNER_FALLBACK: Planner

class RunRequest(_message.Message):
    __slots__ = ("request_id", "question", "options", "session_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    question: str
    options: RunOptions
    session_id: str
    def __init__(self, request_id: _Optional[str] = ..., question: _Optional[str] = ..., options: _Optional[_Union[RunOptions, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class RunOptions(_message.Message):
    __slots__ = ("max_iterations", "allowed_tools", "max_new_tokens", "temperature", "seed", "background")
    MAX_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOOLS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    max_iterations: int
    allowed_tools: _containers.RepeatedScalarFieldContainer[str]
    max_new_tokens: int
    temperature: float
    seed: int
    background: bool
    def __init__(self, max_iterations: _Optional[int] = ..., allowed_tools: _Optional[_Iterable[str]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., background: _Optional[bool] = ...) -> None: ...

class RunResponse(_message.Message):
    __slots__ = ("plan", "tool_call", "tool_result", "answer_delta", "citations", "final", "run_id", "seq")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESULT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_DELTA_FIELD_NUMBER: _ClassVar[int]
    CITATIONS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    plan: Plan
    tool_call: ToolCall
    tool_result: ToolResult
    answer_delta: AnswerDelta
    citations: Citations
    final: Final
    run_id: str
    seq: int
    def __init__(self, plan: _Optional[_Union[Plan, _Mapping]] = ..., tool_call: _Optional[_Union[ToolCall, _Mapping]] = ..., tool_result: _Optional[_Union[ToolResult, _Mapping]] = ..., answer_delta: _Optional[_Union[AnswerDelta, _Mapping]] = ..., citations: _Optional[_Union[Citations, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ..., run_id: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("run_id", "after_seq")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    after_seq: int
    def __init__(self, run_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    def __init__(self, state: _Optional[_Union[RunState, str]] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRunResponse(_message.Message):
    __slots__ = ("run_id", "state", "question", "events", "created_at", "updated_at")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: RunState
    question: str
    events: int
    created_at: float
    updated_at: float
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., question: _Optional[str] = ..., events: _Optional[int] = ..., created_at: _Optional[float] = ..., updated_at: _Optional[float] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("planner", "steps")
    PLANNER_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    planner: Planner
    steps: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, planner: _Optional[_Union[Planner, str]] = ..., steps: _Optional[_Iterable[str]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("call_id", "name", "arguments")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    name: str
    arguments: _struct_pb2.Struct
    def __init__(self, call_id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ToolResult(_message.Message):
    __slots__ = ("call_id", "name", "is_error", "summary", "structured", "duration_ns")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    DURATION_NS_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    name: str
    is_error: bool
    summary: str
    structured: _struct_pb2.Struct
    duration_ns: int
    def __init__(self, call_id: _Optional[str] = ..., name: _Optional[str] = ..., is_error: _Optional[bool] = ..., summary: _Optional[str] = ..., structured: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., duration_ns: _Optional[int] = ...) -> None: ...

class AnswerDelta(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class Citations(_message.Message):
    __slots__ = ("passage_ids",)
    PASSAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    passage_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, passage_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("usage", "timing", "iterations", "trace_id", "planner", "notes", "state")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    PLANNER_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    usage: _common_pb2.Usage
    timing: _common_pb2.Timing
    iterations: int
    trace_id: str
    planner: Planner
    notes: _containers.RepeatedScalarFieldContainer[str]
    state: RunState
    def __init__(self, usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., iterations: _Optional[int] = ..., trace_id: _Optional[str] = ..., planner: _Optional[_Union[Planner, str]] = ..., notes: _Optional[_Iterable[str]] = ..., state: _Optional[_Union[RunState, str]] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id", "page_size", "page_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    page_size: int
    page_token: str
    def __init__(self, session_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("run_id", "question", "answer", "state", "created_at", "answer_truncated")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    question: str
    answer: str
    state: RunState
    created_at: float
    answer_truncated: bool
    def __init__(self, run_id: _Optional[str] = ..., question: _Optional[str] = ..., answer: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., created_at: _Optional[float] = ..., answer_truncated: _Optional[bool] = ...) -> None: ...

class GetSessionResponse(_message.Message):
    __slots__ = ("turns", "next_page_token")
    TURNS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    next_page_token: str
    def __init__(self, turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ("deleted_runs",)
    DELETED_RUNS_FIELD_NUMBER: _ClassVar[int]
    deleted_runs: int
    def __init__(self, deleted_runs: _Optional[int] = ...) -> None: ...
