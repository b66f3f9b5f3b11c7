from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[Model]
    def __init__(self, models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetModelResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: Model
    def __init__(self, model: _Optional[_Union[Model, _Mapping]] = ...) -> None: ...

class Model(_message.Message):
    __slots__ = ("name", "active", "versions", "canary", "previous")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    name: str
    active: str
    versions: _containers.RepeatedCompositeFieldContainer[ModelVersion]
    canary: Canary
    previous: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., active: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[ModelVersion, _Mapping]]] = ..., canary: _Optional[_Union[Canary, _Mapping]] = ..., previous: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelVersion(_message.Message):
    __slots__ = ("name", "engine", "artifact_sha256", "artifact_path", "capabilities", "workers", "state")
    class CapabilitiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class WorkersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Workers
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Workers, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_SHA256_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_PATH_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    engine: str
    artifact_sha256: str
    artifact_path: str
    capabilities: _containers.ScalarMap[str, str]
    workers: _containers.MessageMap[str, Workers]
    state: str
    def __init__(self, name: _Optional[str] = ..., engine: _Optional[str] = ..., artifact_sha256: _Optional[str] = ..., artifact_path: _Optional[str] = ..., capabilities: _Optional[_Mapping[str, str]] = ..., workers: _Optional[_Mapping[str, Workers]] = ..., state: _Optional[str] = ...) -> None: ...

class Workers(_message.Message):
    __slots__ = ("targets",)
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, targets: _Optional[_Iterable[str]] = ...) -> None: ...

class Canary(_message.Message):
    __slots__ = ("version", "percent")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PERCENT_FIELD_NUMBER: _ClassVar[int]
    version: str
    percent: int
    def __init__(self, version: _Optional[str] = ..., percent: _Optional[int] = ...) -> None: ...

class ActivateRequest(_message.Message):
    __slots__ = ("model", "version", "reason")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    reason: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SetCanaryRequest(_message.Message):
    __slots__ = ("model", "version", "percent", "reason")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PERCENT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    percent: int
    reason: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., percent: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("model", "reason")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    model: str
    reason: str
    def __init__(self, model: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ModelEvent(_message.Message):
    __slots__ = ("seq", "at", "actor", "model", "action", "before", "after", "reason", "applied_s")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    APPLIED_S_FIELD_NUMBER: _ClassVar[int]
    seq: int
    at: float
    actor: str
    model: str
    action: str
    before: str
    after: str
    reason: str
    applied_s: float
    def __init__(self, seq: _Optional[int] = ..., at: _Optional[float] = ..., actor: _Optional[str] = ..., model: _Optional[str] = ..., action: _Optional[str] = ..., before: _Optional[str] = ..., after: _Optional[str] = ..., reason: _Optional[str] = ..., applied_s: _Optional[float] = ...) -> None: ...

class ActivateResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: ModelEvent
    def __init__(self, event: _Optional[_Union[ModelEvent, _Mapping]] = ...) -> None: ...

class SetCanaryResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: ModelEvent
    def __init__(self, event: _Optional[_Union[ModelEvent, _Mapping]] = ...) -> None: ...

class RollbackResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: ModelEvent
    def __init__(self, event: _Optional[_Union[ModelEvent, _Mapping]] = ...) -> None: ...
