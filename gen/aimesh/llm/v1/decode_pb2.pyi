from aimesh.common.v1 import common_pb2 as _common_pb2
from aimesh.llm.v1 import kv_cache_pb2 as _kv_cache_pb2
from aimesh.llm.v1 import sampling_pb2 as _sampling_pb2
from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "kv_handle", "prompt_token_ids", "first_token_id", "sampling", "first_token_logprob", "max_new_tokens", "ignore_eos", "first_token_top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_handle: _kv_cache_pb2.KvHandle
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling: _sampling_pb2.SamplingParameters
    first_token_logprob: float
    max_new_tokens: int
    ignore_eos: bool
    first_token_top_logprobs: _sampling_pb2.TopLogprobs
    def __init__(self, request_id: _Optional[str] = ..., kv_handle: _Optional[_Union[_kv_cache_pb2.KvHandle, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParameters, _Mapping]] = ..., first_token_logprob: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., first_token_top_logprobs: _Optional[_Union[_sampling_pb2.TopLogprobs, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("chunk", "complete")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    chunk: TokenChunk
    complete: DecodeComplete
    def __init__(self, chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., complete: _Optional[_Union[DecodeComplete, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.TopLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_sampling_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class DecodeComplete(_message.Message):
    __slots__ = ("finish_reason", "generated_tokens", "timing")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _sampling_pb2.FinishReason
    generated_tokens: int
    timing: _common_pb2.Timing
    def __init__(self, finish_reason: _Optional[_Union[_sampling_pb2.FinishReason, str]] = ..., generated_tokens: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("running", "waiting", "kv_cache_usage", "max_batch_size", "kv_blocks_total", "kv_blocks_free")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_cache_usage: float
    max_batch_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., max_batch_size: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ...) -> None: ...
