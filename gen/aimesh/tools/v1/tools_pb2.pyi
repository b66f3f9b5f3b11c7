from aimesh.common.v1 import common_pb2 as _common_pb2
from google.api import annotations_pb2 as _annotations_pb2
from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListToolsRequest(_message.Message):
    __slots__ = ("cursor",)
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    cursor: str
    def __init__(self, cursor: _Optional[str] = ...) -> None: ...

class ListToolsResponse(_message.Message):
    __slots__ = ("tools", "next_cursor")
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    NEXT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    next_cursor: str
    def __init__(self, tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., next_cursor: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "title", "description", "input_schema", "output_schema", "annotations", "timeout_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    title: str
    description: str
    input_schema: _struct_pb2.Struct
    output_schema: _struct_pb2.Struct
    annotations: ToolAnnotations
    timeout_ms: int
    def __init__(self, name: _Optional[str] = ..., title: _Optional[str] = ..., description: _Optional[str] = ..., input_schema: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., output_schema: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., annotations: _Optional[_Union[ToolAnnotations, _Mapping]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class ToolAnnotations(_message.Message):
    __slots__ = ("read_only", "idempotent", "destructive", "open_world")
    READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENT_FIELD_NUMBER: _ClassVar[int]
    DESTRUCTIVE_FIELD_NUMBER: _ClassVar[int]
    OPEN_WORLD_FIELD_NUMBER: _ClassVar[int]
    read_only: bool
    idempotent: bool
    destructive: bool
    open_world: bool
    def __init__(self, read_only: _Optional[bool] = ..., idempotent: _Optional[bool] = ..., destructive: _Optional[bool] = ..., open_world: _Optional[bool] = ...) -> None: ...

class CallToolRequest(_message.Message):
    __slots__ = ("request_id", "name", "arguments", "idempotency_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    name: str
    arguments: _struct_pb2.Struct
    idempotency_key: str
    def __init__(self, request_id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class CallToolResponse(_message.Message):
    __slots__ = ("progress", "result")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    progress: Progress
    result: CallToolResult
    def __init__(self, progress: _Optional[_Union[Progress, _Mapping]] = ..., result: _Optional[_Union[CallToolResult, _Mapping]] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("progress", "total", "message")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    progress: float
    total: float
    message: str
    def __init__(self, progress: _Optional[float] = ..., total: _Optional[float] = ..., message: _Optional[str] = ...) -> None: ...

class CallToolResult(_message.Message):
    __slots__ = ("content", "structured_content", "is_error", "timing")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_CONTENT_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    content: _containers.RepeatedCompositeFieldContainer[Content]
    structured_content: _struct_pb2.Struct
    is_error: bool
    timing: _common_pb2.Timing
    def __init__(self, content: _Optional[_Iterable[_Union[Content, _Mapping]]] = ..., structured_content: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., is_error: _Optional[bool] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ...) -> None: ...

class Content(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: ImageContent
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[ImageContent, _Mapping]] = ...) -> None: ...

class ImageContent(_message.Message):
    __slots__ = ("data", "mime_type")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ...) -> None: ...
