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

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "lease_ttl_ms", "handle_id", "release_token", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParameters
    lease_ttl_ms: int
    handle_id: str
    release_token: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParameters, _Mapping]] = ..., lease_ttl_ms: _Optional[int] = ..., handle_id: _Optional[str] = ..., release_token: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_token_logprob", "kv_handle", "prompt_tokens", "timing", "cached_tokens", "first_token_top_logprobs", "other_choices")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OTHER_CHOICES_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_logprob: float
    kv_handle: _kv_cache_pb2.KvHandle
    prompt_tokens: int
    timing: _common_pb2.Timing
    cached_tokens: int
    first_token_top_logprobs: _sampling_pb2.TopLogprobs
    other_choices: _containers.RepeatedCompositeFieldContainer[ChoiceStart]
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., kv_handle: _Optional[_Union[_kv_cache_pb2.KvHandle, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., first_token_top_logprobs: _Optional[_Union[_sampling_pb2.TopLogprobs, _Mapping]] = ..., other_choices: _Optional[_Iterable[_Union[ChoiceStart, _Mapping]]] = ...) -> None: ...

class ChoiceStart(_message.Message):
    __slots__ = ("first_token_id", "first_token_logprob", "first_token_top_logprobs", "kv_handle")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_logprob: float
    first_token_top_logprobs: _sampling_pb2.TopLogprobs
    kv_handle: _kv_cache_pb2.KvHandle
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., first_token_top_logprobs: _Optional[_Union[_sampling_pb2.TopLogprobs, _Mapping]] = ..., kv_handle: _Optional[_Union[_kv_cache_pb2.KvHandle, _Mapping]] = ...) -> None: ...
