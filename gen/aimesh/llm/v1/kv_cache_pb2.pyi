from aimesh.common.v1 import common_pb2 as _common_pb2
from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvPart(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_PART_UNSPECIFIED: _ClassVar[KvPart]
    KV_PART_KEY: _ClassVar[KvPart]
    KV_PART_VALUE: _ClassVar[KvPart]
    KV_PART_STATE: _ClassVar[KvPart]
KV_PART_UNSPECIFIED: KvPart
KV_PART_KEY: KvPart
KV_PART_VALUE: KvPart
KV_PART_STATE: KvPart

class KvHandle(_message.Message):
    __slots__ = ("id", "address", "num_tokens", "num_layers", "num_kv_heads", "head_dim", "dtype", "lease_expires_unix_ms", "traceparent", "format")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    num_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    lease_expires_unix_ms: int
    traceparent: str
    format: KvFormat
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ..., traceparent: _Optional[str] = ..., format: _Optional[_Union[KvFormat, _Mapping]] = ...) -> None: ...

class KvFormat(_message.Message):
    __slots__ = ("engine", "engine_version", "model_sha256", "kv_types", "layout", "state_bytes")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    KV_TYPES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    engine: str
    engine_version: str
    model_sha256: str
    kv_types: str
    layout: str
    state_bytes: int
    def __init__(self, engine: _Optional[str] = ..., engine_version: _Optional[str] = ..., model_sha256: _Optional[str] = ..., kv_types: _Optional[str] = ..., layout: _Optional[str] = ..., state_bytes: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("request_id", "handle_id", "max_chunk_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    handle_id: str
    max_chunk_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., handle_id: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("chunk", "complete")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    chunk: KvChunk
    complete: PullComplete
    def __init__(self, chunk: _Optional[_Union[KvChunk, _Mapping]] = ..., complete: _Optional[_Union[PullComplete, _Mapping]] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("sequence", "layer", "part", "dtype", "shape", "byte_offset", "data")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    layer: int
    part: KvPart
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    byte_offset: int
    data: bytes
    def __init__(self, sequence: _Optional[int] = ..., layer: _Optional[int] = ..., part: _Optional[_Union[KvPart, str]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., byte_offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PullComplete(_message.Message):
    __slots__ = ("num_chunks", "total_bytes", "timing")
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    num_chunks: int
    total_bytes: int
    timing: _common_pb2.Timing
    def __init__(self, num_chunks: _Optional[int] = ..., total_bytes: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("handle_id", "release_token")
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    release_token: str
    def __init__(self, handle_id: _Optional[str] = ..., release_token: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
