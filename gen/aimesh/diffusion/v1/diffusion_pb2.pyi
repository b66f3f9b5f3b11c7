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

class Sampler(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLER_UNSPECIFIED: _ClassVar[Sampler]
    SAMPLER_DDPM: _ClassVar[Sampler]
    SAMPLER_DDIM: _ClassVar[Sampler]
    SAMPLER_CONSISTENCY: _ClassVar[Sampler]
SAMPLER_UNSPECIFIED: Sampler
SAMPLER_DDPM: Sampler
SAMPLER_DDIM: Sampler
SAMPLER_CONSISTENCY: Sampler

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "num_images", "steps", "seed", "guidance_scale", "sampler", "preview_every_steps", "conditioning", "width", "height")
    class ConditioningEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_IMAGES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    CONDITIONING_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    num_images: int
    steps: int
    seed: int
    guidance_scale: float
    sampler: Sampler
    preview_every_steps: int
    conditioning: _containers.ScalarMap[str, float]
    width: int
    height: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., num_images: _Optional[int] = ..., steps: _Optional[int] = ..., seed: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., sampler: _Optional[_Union[Sampler, str]] = ..., preview_every_steps: _Optional[int] = ..., conditioning: _Optional[_Mapping[str, float]] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("queued", "progress", "preview", "image", "summary")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    queued: Queued
    progress: Progress
    preview: Preview
    image: Image
    summary: Summary
    def __init__(self, queued: _Optional[_Union[Queued, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., preview: _Optional[_Union[Preview, _Mapping]] = ..., image: _Optional[_Union[Image, _Mapping]] = ..., summary: _Optional[_Union[Summary, _Mapping]] = ...) -> None: ...

class Queued(_message.Message):
    __slots__ = ("job_id", "position")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    position: int
    def __init__(self, job_id: _Optional[str] = ..., position: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("step", "total_steps", "eta_ms")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    ETA_MS_FIELD_NUMBER: _ClassVar[int]
    step: int
    total_steps: int
    eta_ms: int
    def __init__(self, step: _Optional[int] = ..., total_steps: _Optional[int] = ..., eta_ms: _Optional[int] = ...) -> None: ...

class Preview(_message.Message):
    __slots__ = ("index", "step", "png")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PNG_FIELD_NUMBER: _ClassVar[int]
    index: int
    step: int
    png: bytes
    def __init__(self, index: _Optional[int] = ..., step: _Optional[int] = ..., png: _Optional[bytes] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("index", "seed", "png", "width", "height")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PNG_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    index: int
    seed: int
    png: bytes
    width: int
    height: int
    def __init__(self, index: _Optional[int] = ..., seed: _Optional[int] = ..., png: _Optional[bytes] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class Summary(_message.Message):
    __slots__ = ("job_id", "seeds", "timing")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    seeds: _containers.RepeatedScalarFieldContainer[int]
    timing: _common_pb2.Timing
    def __init__(self, job_id: _Optional[str] = ..., seeds: _Optional[_Iterable[int]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "description", "conditioning", "width", "height", "max_steps", "max_images", "samplers", "default_steps", "sizes", "default_guidance_scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CONDITIONING_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_STEPS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    conditioning: str
    width: int
    height: int
    max_steps: int
    max_images: int
    samplers: _containers.RepeatedScalarFieldContainer[Sampler]
    default_steps: int
    sizes: _containers.RepeatedCompositeFieldContainer[Size]
    default_guidance_scale: float
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., conditioning: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., max_steps: _Optional[int] = ..., max_images: _Optional[int] = ..., samplers: _Optional[_Iterable[_Union[Sampler, str]]] = ..., default_steps: _Optional[int] = ..., sizes: _Optional[_Iterable[_Union[Size, _Mapping]]] = ..., default_guidance_scale: _Optional[float] = ...) -> None: ...

class Size(_message.Message):
    __slots__ = ("width", "height")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    width: int
    height: int
    def __init__(self, width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...
