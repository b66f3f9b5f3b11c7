from google.api import annotations_pb2 as _annotations_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EchoStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("payload", "response_size", "delay_ms", "response_status", "echo_metadata_keys")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_STATUS_FIELD_NUMBER: _ClassVar[int]
    ECHO_METADATA_KEYS_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    response_size: int
    delay_ms: int
    response_status: EchoStatus
    echo_metadata_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, payload: _Optional[bytes] = ..., response_size: _Optional[int] = ..., delay_ms: _Optional[int] = ..., response_status: _Optional[_Union[EchoStatus, _Mapping]] = ..., echo_metadata_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class EchoResponse(_message.Message):
    __slots__ = ("payload", "deadline_remaining_ms", "trace_id")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    deadline_remaining_ms: int
    trace_id: str
    def __init__(self, payload: _Optional[bytes] = ..., deadline_remaining_ms: _Optional[int] = ..., trace_id: _Optional[str] = ...) -> None: ...

class EchoStreamRequest(_message.Message):
    __slots__ = ("count", "interval_ms", "response_size", "response_status")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_STATUS_FIELD_NUMBER: _ClassVar[int]
    count: int
    interval_ms: int
    response_size: int
    response_status: EchoStatus
    def __init__(self, count: _Optional[int] = ..., interval_ms: _Optional[int] = ..., response_size: _Optional[int] = ..., response_status: _Optional[_Union[EchoStatus, _Mapping]] = ...) -> None: ...

class EchoStreamResponse(_message.Message):
    __slots__ = ("index", "payload")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    index: int
    payload: bytes
    def __init__(self, index: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class RelayRequest(_message.Message):
    __slots__ = ("hops", "count", "interval_ms")
    HOPS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    hops: _containers.RepeatedScalarFieldContainer[str]
    count: int
    interval_ms: int
    def __init__(self, hops: _Optional[_Iterable[str]] = ..., count: _Optional[int] = ..., interval_ms: _Optional[int] = ...) -> None: ...

class RelayResponse(_message.Message):
    __slots__ = ("index", "hops")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    index: int
    hops: _containers.RepeatedCompositeFieldContainer[HopReport]
    def __init__(self, index: _Optional[int] = ..., hops: _Optional[_Iterable[_Union[HopReport, _Mapping]]] = ...) -> None: ...

class RelayUnaryRequest(_message.Message):
    __slots__ = ("hops", "delay_ms")
    HOPS_FIELD_NUMBER: _ClassVar[int]
    DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    hops: _containers.RepeatedScalarFieldContainer[str]
    delay_ms: int
    def __init__(self, hops: _Optional[_Iterable[str]] = ..., delay_ms: _Optional[int] = ...) -> None: ...

class RelayUnaryResponse(_message.Message):
    __slots__ = ("hops",)
    HOPS_FIELD_NUMBER: _ClassVar[int]
    hops: _containers.RepeatedCompositeFieldContainer[HopReport]
    def __init__(self, hops: _Optional[_Iterable[_Union[HopReport, _Mapping]]] = ...) -> None: ...

class HopReport(_message.Message):
    __slots__ = ("server", "deadline_remaining_ms", "trace_id", "request_id", "client")
    SERVER_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    server: str
    deadline_remaining_ms: int
    trace_id: str
    request_id: str
    client: str
    def __init__(self, server: _Optional[str] = ..., deadline_remaining_ms: _Optional[int] = ..., trace_id: _Optional[str] = ..., request_id: _Optional[str] = ..., client: _Optional[str] = ...) -> None: ...
