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

class Distance(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DISTANCE_UNSPECIFIED: _ClassVar[Distance]
    DISTANCE_COSINE: _ClassVar[Distance]
    DISTANCE_DOT: _ClassVar[Distance]
    DISTANCE_EUCLID: _ClassVar[Distance]

class SearchMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEARCH_MODE_UNSPECIFIED: _ClassVar[SearchMode]
    SEARCH_MODE_DENSE: _ClassVar[SearchMode]
    SEARCH_MODE_SPARSE: _ClassVar[SearchMode]
    SEARCH_MODE_HYBRID: _ClassVar[SearchMode]

class Retriever(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RETRIEVER_UNSPECIFIED: _ClassVar[Retriever]
    RETRIEVER_DENSE: _ClassVar[Retriever]
    RETRIEVER_SPARSE: _ClassVar[Retriever]
DISTANCE_UNSPECIFIED: Distance
DISTANCE_COSINE: Distance
DISTANCE_DOT: Distance
DISTANCE_EUCLID: Distance
SEARCH_MODE_UNSPECIFIED: SearchMode
SEARCH_MODE_DENSE: SearchMode
SEARCH_MODE_SPARSE: SearchMode
SEARCH_MODE_HYBRID: SearchMode
RETRIEVER_UNSPECIFIED: Retriever
RETRIEVER_DENSE: Retriever
RETRIEVER_SPARSE: Retriever

class CreateCollectionRequest(_message.Message):
    __slots__ = ("request_id", "collection", "vector_size", "distance", "sparse_enabled", "on_disk")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    VECTOR_SIZE_FIELD_NUMBER: _ClassVar[int]
    DISTANCE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_ENABLED_FIELD_NUMBER: _ClassVar[int]
    ON_DISK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    collection: str
    vector_size: int
    distance: Distance
    sparse_enabled: bool
    on_disk: bool
    def __init__(self, request_id: _Optional[str] = ..., collection: _Optional[str] = ..., vector_size: _Optional[int] = ..., distance: _Optional[_Union[Distance, str]] = ..., sparse_enabled: _Optional[bool] = ..., on_disk: _Optional[bool] = ...) -> None: ...

class CreateCollectionResponse(_message.Message):
    __slots__ = ("created", "vector_size", "timing")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    VECTOR_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    created: bool
    vector_size: int
    timing: _common_pb2.Timing
    def __init__(self, created: _Optional[bool] = ..., vector_size: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ...) -> None: ...

class UpsertRequest(_message.Message):
    __slots__ = ("request_id", "collection", "documents")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    collection: str
    documents: _containers.RepeatedCompositeFieldContainer[Document]
    def __init__(self, request_id: _Optional[str] = ..., collection: _Optional[str] = ..., documents: _Optional[_Iterable[_Union[Document, _Mapping]]] = ...) -> None: ...

class Document(_message.Message):
    __slots__ = ("id", "text", "payload")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    id: str
    text: str
    payload: _struct_pb2.Struct
    def __init__(self, id: _Optional[str] = ..., text: _Optional[str] = ..., payload: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class UpsertResponse(_message.Message):
    __slots__ = ("received", "upserted", "unchanged", "ids", "timing")
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    UPSERTED_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    received: int
    upserted: int
    unchanged: int
    ids: _containers.RepeatedScalarFieldContainer[str]
    timing: _common_pb2.Timing
    def __init__(self, received: _Optional[int] = ..., upserted: _Optional[int] = ..., unchanged: _Optional[int] = ..., ids: _Optional[_Iterable[str]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ...) -> None: ...

class SearchRequest(_message.Message):
    __slots__ = ("request_id", "collection", "query", "top_k", "filter", "score_threshold", "mode", "with_payload", "rerank")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    SCORE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    WITH_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    RERANK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    collection: str
    query: str
    top_k: int
    filter: Filter
    score_threshold: float
    mode: SearchMode
    with_payload: bool
    rerank: bool
    def __init__(self, request_id: _Optional[str] = ..., collection: _Optional[str] = ..., query: _Optional[str] = ..., top_k: _Optional[int] = ..., filter: _Optional[_Union[Filter, _Mapping]] = ..., score_threshold: _Optional[float] = ..., mode: _Optional[_Union[SearchMode, str]] = ..., with_payload: _Optional[bool] = ..., rerank: _Optional[bool] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("hits", "timing", "note")
    HITS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.RepeatedCompositeFieldContainer[Hit]
    timing: _common_pb2.Timing
    note: str
    def __init__(self, hits: _Optional[_Iterable[_Union[Hit, _Mapping]]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., note: _Optional[str] = ...) -> None: ...

class Hit(_message.Message):
    __slots__ = ("id", "score", "text", "payload", "sources")
    ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    id: str
    score: float
    text: str
    payload: _struct_pb2.Struct
    sources: _containers.RepeatedCompositeFieldContainer[HitSource]
    def __init__(self, id: _Optional[str] = ..., score: _Optional[float] = ..., text: _Optional[str] = ..., payload: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., sources: _Optional[_Iterable[_Union[HitSource, _Mapping]]] = ...) -> None: ...

class HitSource(_message.Message):
    __slots__ = ("retriever", "rank", "score")
    RETRIEVER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    retriever: Retriever
    rank: int
    score: float
    def __init__(self, retriever: _Optional[_Union[Retriever, str]] = ..., rank: _Optional[int] = ..., score: _Optional[float] = ...) -> None: ...

class Filter(_message.Message):
    __slots__ = ("must", "should", "must_not")
    MUST_FIELD_NUMBER: _ClassVar[int]
    SHOULD_FIELD_NUMBER: _ClassVar[int]
    MUST_NOT_FIELD_NUMBER: _ClassVar[int]
    must: _containers.RepeatedCompositeFieldContainer[Condition]
    should: _containers.RepeatedCompositeFieldContainer[Condition]
    must_not: _containers.RepeatedCompositeFieldContainer[Condition]
    def __init__(self, must: _Optional[_Iterable[_Union[Condition, _Mapping]]] = ..., should: _Optional[_Iterable[_Union[Condition, _Mapping]]] = ..., must_not: _Optional[_Iterable[_Union[Condition, _Mapping]]] = ...) -> None: ...

class Condition(_message.Message):
    __slots__ = ("key", "keyword", "integer", "boolean", "range")
    KEY_FIELD_NUMBER: _ClassVar[int]
    KEYWORD_FIELD_NUMBER: _ClassVar[int]
    INTEGER_FIELD_NUMBER: _ClassVar[int]
    BOOLEAN_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    key: str
    keyword: str
    integer: int
    boolean: bool
    range: Range
    def __init__(self, key: _Optional[str] = ..., keyword: _Optional[str] = ..., integer: _Optional[int] = ..., boolean: _Optional[bool] = ..., range: _Optional[_Union[Range, _Mapping]] = ...) -> None: ...

class Range(_message.Message):
    __slots__ = ("gt", "gte", "lt", "lte")
    GT_FIELD_NUMBER: _ClassVar[int]
    GTE_FIELD_NUMBER: _ClassVar[int]
    LT_FIELD_NUMBER: _ClassVar[int]
    LTE_FIELD_NUMBER: _ClassVar[int]
    gt: float
    gte: float
    lt: float
    lte: float
    def __init__(self, gt: _Optional[float] = ..., gte: _Optional[float] = ..., lt: _Optional[float] = ..., lte: _Optional[float] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("request_id", "collection", "ids", "filter", "allow_bulk")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    ALLOW_BULK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    collection: str
    ids: _containers.RepeatedScalarFieldContainer[str]
    filter: Filter
    allow_bulk: bool
    def __init__(self, request_id: _Optional[str] = ..., collection: _Optional[str] = ..., ids: _Optional[_Iterable[str]] = ..., filter: _Optional[_Union[Filter, _Mapping]] = ..., allow_bulk: _Optional[bool] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted", "timing")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    timing: _common_pb2.Timing
    def __init__(self, deleted: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ...) -> None: ...
