from aimesh.common.v1 import common_pb2 as _common_pb2
from google.api import annotations_pb2 as _annotations_pb2
from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TruncationDirection(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRUNCATION_DIRECTION_UNSPECIFIED: _ClassVar[TruncationDirection]
    TRUNCATION_DIRECTION_RIGHT: _ClassVar[TruncationDirection]
    TRUNCATION_DIRECTION_LEFT: _ClassVar[TruncationDirection]
TRUNCATION_DIRECTION_UNSPECIFIED: TruncationDirection
TRUNCATION_DIRECTION_RIGHT: TruncationDirection
TRUNCATION_DIRECTION_LEFT: TruncationDirection

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "inputs", "normalize", "truncate", "truncation_direction")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    normalize: bool
    truncate: bool
    truncation_direction: TruncationDirection
    def __init__(self, request_id: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., normalize: _Optional[bool] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[_Union[TruncationDirection, str]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "dimensions", "model", "usage", "timing")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    dimensions: int
    model: str
    usage: _common_pb2.Usage
    timing: _common_pb2.Timing
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., dimensions: _Optional[int] = ..., model: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...
