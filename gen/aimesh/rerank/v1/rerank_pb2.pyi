from aimesh.common.v1 import common_pb2 as _common_pb2
from google.api import annotations_pb2 as _annotations_pb2
from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RerankRequest(_message.Message):
    __slots__ = ("request_id", "query", "documents", "top_n", "truncate", "return_text", "raw_scores", "return_documents")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    RETURN_TEXT_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    query: str
    documents: _containers.RepeatedCompositeFieldContainer[Document]
    top_n: int
    truncate: bool
    return_text: bool
    raw_scores: bool
    return_documents: bool
    def __init__(self, request_id: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Iterable[_Union[Document, _Mapping]]] = ..., top_n: _Optional[int] = ..., truncate: _Optional[bool] = ..., return_text: _Optional[bool] = ..., raw_scores: _Optional[bool] = ..., return_documents: _Optional[bool] = ...) -> None: ...

class Document(_message.Message):
    __slots__ = ("id", "text")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    id: str
    text: str
    def __init__(self, id: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("results", "model", "timing", "usage")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RerankResult]
    model: str
    timing: _common_pb2.Timing
    usage: _common_pb2.Usage
    def __init__(self, results: _Optional[_Iterable[_Union[RerankResult, _Mapping]]] = ..., model: _Optional[str] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class RerankResult(_message.Message):
    __slots__ = ("index", "id", "score", "text")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    score: float
    text: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., score: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...
