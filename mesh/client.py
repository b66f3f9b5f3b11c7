"""Channels to other services: one factory, so every call gets the same guarantees.

Every channel carries, outermost first: tracing (W3C traceparent), then one mesh layer
with the request id, the deadline budget and a per-target circuit breaker. Its service
config retries only methods the proto marks idempotent (`option idempotency_level`),
only on UNAVAILABLE, under retryThrottling, and balances round_robin over every address
a `dns:///` name resolves to.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.descriptor_pb2 import MethodOptions

from mesh import interceptors, tracing
from mesh.breaker import CircuitBreaker
from mesh.caller_token import token_signer
from mesh.config import ClientSettings, MeshSettings, TransportSettings
from mesh.deadline import DeadlinePolicy
from mesh.tls import channel_credentials, terminates_here

_IDEMPOTENT_LEVELS = frozenset({MethodOptions.NO_SIDE_EFFECTS, MethodOptions.IDEMPOTENT})


def idempotent_methods(services: Iterable[ServiceDescriptor]) -> list[tuple[str, str]]:
    """(service, method) pairs the protos declare safe to retry; client streams never are."""
    safe = []
    for service in services:
        for method in service.methods:
            level = method.GetOptions().idempotency_level
            if level in _IDEMPOTENT_LEVELS and not method.client_streaming:
                safe.append((service.full_name, method.name))
    return safe


def service_config(services: Iterable[ServiceDescriptor], client: ClientSettings) -> dict[str, Any]:
    config: dict[str, Any] = {
        "loadBalancingConfig": [{"round_robin": {}}],
        "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
    }
    retryable = idempotent_methods(services)
    if retryable:
        config["methodConfig"] = [
            {
                "name": [{"service": service, "method": method} for service, method in retryable],
                "retryPolicy": {
                    "maxAttempts": client.retry_max_attempts,
                    "initialBackoff": f"{client.retry_initial_backoff_s}s",
                    "maxBackoff": f"{client.retry_max_backoff_s}s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    return config


def transport_options(transport: TransportSettings) -> list[tuple[str, Any]]:
    """Message-size and keepalive options shared by channels and servers."""
    return [
        ("grpc.max_send_message_length", transport.max_message_bytes),
        ("grpc.max_receive_message_length", transport.max_message_bytes),
        ("grpc.keepalive_time_ms", int(transport.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(transport.keepalive_timeout_s * 1000)),
    ]


def channel_options(
    settings: MeshSettings,
    services: Iterable[ServiceDescriptor] = (),
    *,
    shared_subchannels: bool = False,
) -> list[tuple[str, Any]]:
    """Every option a mesh channel sets, so none is left to grpc's defaults by accident.

    A channel owns its connections unless `shared_subchannels`: grpc's global subchannel
    pool would hand it the subchannel of any channel with the same address and options,
    and one left pointing at a stopped server holds that subchannel in reconnect backoff,
    so a server started later on the same port is refused to the new channel's calls."""
    client = settings.client
    return [
        ("grpc.use_local_subchannel_pool", 0 if shared_subchannels else 1),
        *transport_options(settings.transport),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 1),
        ("grpc.initial_reconnect_backoff_ms", int(client.reconnect_initial_backoff_s * 1000)),
        ("grpc.max_reconnect_backoff_ms", int(client.reconnect_max_backoff_s * 1000)),
        ("grpc.service_config", json.dumps(service_config(services, client))),
    ]


def create_channel(
    target: str,
    settings: MeshSettings,
    *,
    services: Iterable[ServiceDescriptor] = (),
    breaker: CircuitBreaker | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    server_name: str | None = None,
    shared_subchannels: bool = False,
) -> grpc.aio.Channel:
    """A channel with the mesh's interceptors; TLS with `credentials`, or with the mesh's
    own when `[tls]` is configured (plaintext and a signed token per call where a sidecar
    ends TLS: mesh/caller_token.py). Over TLS, `server_name` is the name the server's
    certificate must hold instead of the target's host: a pod's own address (where a KV
    handle points) is in no certificate a Deployment's pods share, its service's name is.
    `shared_subchannels`: as channel_options."""
    client = settings.client
    breaker = breaker or CircuitBreaker(target, client.breaker)
    tls = settings.tls
    tokens = token_signer(tls) if tls is not None and tls.caller_tokens else None
    chain = [
        *tracing.client_interceptors(),
        *interceptors.client_interceptors(DeadlinePolicy(client), breaker, tokens),
    ]
    options = channel_options(settings, services, shared_subchannels=shared_subchannels)
    if server_name is not None:
        options.append(("grpc.ssl_target_name_override", server_name))
    if credentials is None and tls is not None and terminates_here(tls):
        credentials = channel_credentials(tls)
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options=options, interceptors=chain)
    return grpc.aio.insecure_channel(target, options=options, interceptors=chain)


class ChannelPool:
    """One channel (and so one breaker) per target, shared by every stub in a process."""

    def __init__(self, settings: MeshSettings) -> None:
        self.settings = settings
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.breakers: dict[str, CircuitBreaker] = {}

    def get(
        self, target: str, *services: ServiceDescriptor, server_name: str | None = None
    ) -> grpc.aio.Channel:
        """The target's channel, made on first use (`server_name`: create_channel's)."""
        channel = self._channels.get(target)
        if channel is None:
            breaker = CircuitBreaker(target, self.settings.client.breaker)
            channel = create_channel(
                target, self.settings, services=services, breaker=breaker, server_name=server_name
            )
            self._channels[target] = channel
            self.breakers[target] = breaker
        return channel

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()
