"""Small helpers interceptors share: method names, handler wrapping, metadata.

grpc.aio server interceptors only see the method name and metadata; anything that needs
the ServicerContext (deadline, status code, abort) has to wrap the handler's behaviour.
These helpers do that once, for all four RPC arities.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from google.protobuf import empty_pb2
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from google.protobuf.unknown_fields import UnknownFieldSet

from mesh.failures import FieldViolation, InvalidInput

# Infrastructure services are never queued, counted as traffic or traced: a readiness
# probe must answer even when every compute slot is busy.
INFRASTRUCTURE_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
        "aimesh.mesh.v1.InfoService",
    }
)

UnaryBehavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamBehavior = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]


def split_method(full_method: str) -> tuple[str, str]:
    """'/aimesh.echo.v1.EchoService/Echo' -> ('aimesh.echo.v1.EchoService', 'Echo')."""
    service, _, method = full_method.lstrip("/").partition("/")
    return service, method


def is_infrastructure(full_method: str) -> bool:
    return split_method(full_method)[0] in INFRASTRUCTURE_SERVICES


def unparsable_field(descriptor: Descriptor, data: bytes) -> str:
    """Which top-level field of a message protobuf refused to parse: a string that is not
    UTF-8, or a Struct nested past the parser's recursion limit ("request" when the bytes
    are not protobuf at all)."""
    try:
        fields = UnknownFieldSet(empty_pb2.Empty.FromString(data))
    except DecodeError:
        return "request"
    for field in fields:
        known = descriptor.fields_by_number.get(field.field_number)
        if known is None or not isinstance(field.data, bytes):
            continue
        try:
            if known.message_type is None:
                field.data.decode()
            else:
                GetMessageClass(known.message_type).FromString(field.data)
        except (UnicodeDecodeError, DecodeError):
            return known.name
    return "request"


def lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """A request parser that returns an InvalidInput (for the handler wrapper to raise)
    instead of failing: grpc answers bytes its parser refuses with an error that blames
    the server (UNKNOWN / INTERNAL), when the caller sent them."""
    message = getattr(deserializer, "__self__", None)
    if deserializer is None or not isinstance(message, type) or not issubclass(message, Message):
        return deserializer

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError:
            field = unparsable_field(message.DESCRIPTOR, data)
            why = "could not be parsed: text that is not UTF-8, or nested too deeply"
            return InvalidInput([FieldViolation(field, why)])

    return parse


async def checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A client stream whose unparsable message raises its InvalidInput where it comes."""
    async for request in requests:
        if isinstance(request, InvalidInput):
            raise request
        yield request


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    wrap_unary: Callable[[UnaryBehavior], UnaryBehavior],
    wrap_stream: Callable[[StreamBehavior], StreamBehavior],
) -> grpc.RpcMethodHandler:
    """A copy of `handler` whose behaviour is wrapped: `wrap_unary` when the handler returns
    one response (whatever the request arity), `wrap_stream` when it is an async generator.

    Handlers must be written in async-generator style, not `context.write`: that is also
    what the OpenTelemetry aio server interceptor requires (opentelemetry-python-contrib
    #3066). Requests are parsed leniently: the wrappers raise the InvalidInput of one that
    did not parse (`checked_stream` for client streams).
    """
    codecs = {
        "request_deserializer": lenient(handler.request_deserializer),
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), **codecs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream), **codecs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary), **codecs)
    return grpc.stream_stream_rpc_method_handler(wrap_stream(handler.stream_stream), **codecs)


def incoming(context: grpc.aio.ServicerContext, key: str, max_length: int) -> str | None:
    """The first text value of `key` in a call's metadata, cut to `max_length`."""
    for name, value in context.invocation_metadata() or ():
        if name == key and isinstance(value, str):
            return value[:max_length]
    return None


def carried(metadata: Any, values: Mapping[str, str]) -> grpc.aio.Metadata | Any:
    """Outgoing metadata with each non-empty value of `values` added under its key,
    unless the caller set that key itself; built once for all of them."""
    missing = [(key, value) for key, value in values.items() if value]
    if not missing:
        return metadata
    outgoing = grpc.aio.Metadata(*(metadata or ()))
    for key, value in missing:
        if key not in outgoing:
            outgoing.add(key, value)
    return outgoing


def method_name(details: grpc.aio.ClientCallDetails) -> str:
    """grpc.aio hands interceptors the method as bytes (grpc/grpc#31092); normalise it."""
    method = details.method
    return method.decode() if isinstance(method, bytes) else method
