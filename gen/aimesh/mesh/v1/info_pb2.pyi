from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("service", "version", "models", "loaded", "external_servers")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_SERVERS_FIELD_NUMBER: _ClassVar[int]
    service: str
    version: str
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    loaded: bool
    external_servers: _containers.RepeatedCompositeFieldContainer[ExternalServer]
    def __init__(self, service: _Optional[str] = ..., version: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., loaded: _Optional[bool] = ..., external_servers: _Optional[_Iterable[_Union[ExternalServer, _Mapping]]] = ...) -> None: ...

class ExternalServer(_message.Message):
    __slots__ = ("name", "protocol", "address", "connected", "problem")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    name: str
    protocol: str
    address: str
    connected: bool
    problem: str
    def __init__(self, name: _Optional[str] = ..., protocol: _Optional[str] = ..., address: _Optional[str] = ..., connected: _Optional[bool] = ..., problem: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "revision", "sha256", "dtype", "device", "engine", "limits")
    class LimitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    revision: str
    sha256: str
    dtype: str
    device: str
    engine: str
    limits: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., revision: _Optional[str] = ..., sha256: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., engine: _Optional[str] = ..., limits: _Optional[_Mapping[str, str]] = ...) -> None: ...
