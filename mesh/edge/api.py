"""What the edge needs to know about the API, read from the compiled protos themselves.

The JSON transcoder needs a descriptor set, routes need each method's path, whether it
streams and whether it is safe to retry. All of it comes from the generated modules'
descriptors, so a new RPC reaches the edge without anyone copying it into a config file.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from dataclasses import dataclass

from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FileDescriptor, ServiceDescriptor
from google.protobuf.descriptor_pb2 import FileDescriptorProto, FileDescriptorSet

from mesh.client import idempotent_methods

# The root package of the generated code (gen/aimesh); importing its *_pb2 modules fills
# the default descriptor pool without importing any service implementation.
PROTO_PACKAGE = "aimesh"


@dataclass(frozen=True)
class EdgeMethod:
    path: str  # '/aimesh.llm.v1.GenerationService/Generate', what HTTP/2 carries
    server_streaming: bool
    client_streaming: bool
    idempotent: bool


def load_services(names: Iterable[str]) -> list[ServiceDescriptor]:
    """Descriptors of the named proto services; an unknown name is a configuration error."""
    package = importlib.import_module(PROTO_PACKAGE)
    for module in pkgutil.walk_packages(package.__path__, f"{PROTO_PACKAGE}."):
        if module.name.endswith("_pb2"):
            importlib.import_module(module.name)
    pool = descriptor_pool.Default()
    services = []
    for name in names:
        try:
            services.append(pool.FindServiceByName(name))
        except KeyError:
            raise ValueError(f"no proto service named {name!r}") from None
    return services


def methods(services: Iterable[ServiceDescriptor]) -> list[EdgeMethod]:
    services = list(services)
    safe = {f"/{service}/{method}" for service, method in idempotent_methods(services)}
    return [
        EdgeMethod(
            path=f"/{service.full_name}/{method.name}",
            server_streaming=method.server_streaming,
            client_streaming=method.client_streaming,
            idempotent=f"/{service.full_name}/{method.name}" in safe,
        )
        for service in services
        for method in service.methods
    ]


def descriptor_set(files: Iterable[FileDescriptor]) -> bytes:
    """A serialized FileDescriptorSet of `files` and everything they import, dependencies
    first, as `protoc --include_imports --descriptor_set_out` writes it."""
    ordered: list[FileDescriptor] = []
    seen: set[str] = set()

    def visit(file: FileDescriptor) -> None:
        if file.name in seen:
            return
        seen.add(file.name)
        for dependency in file.dependencies:
            visit(dependency)
        ordered.append(file)

    for file in files:
        visit(file)
    protos = [FileDescriptorProto.FromString(file.serialized_pb) for file in ordered]
    return FileDescriptorSet(file=protos).SerializeToString()
