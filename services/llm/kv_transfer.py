"""The client side of KV transfer: pulling a leased KV from a prefill worker, and
releasing it in a way that survives the caller being cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re

import grpc

from aimesh.llm.v1 import kv_cache_pb2, kv_cache_pb2_grpc
from mesh.client import ChannelPool
from mesh.failures import NotFound
from services.llm import kv_codec
from services.llm.kv_codec import KvState

KV_CACHE = kv_cache_pb2.DESCRIPTOR.services_by_name["KvCacheService"]
# A KV handle id is a bearer capability (whoever holds it may pull or release the KV), so
# it is 128 random bits, written as prefill writes them; a caller that picks its own (to
# release a KV whose Prefill answer it never got) must pick it the same way.
HANDLE_ID = re.compile(r"[0-9a-f]{32}")
HANDLE_ID_RULE = "must be 32 lowercase hex digits (128 random bits), as new_handle_id() makes"


def new_handle_id() -> str:
    return os.urandom(16).hex()


PULL_CHUNK_BYTES = kv_codec.MAX_CHUNK_BYTES
# Whose certificate a handle's address must present under TLS: the address is a prefill
# pod's own (in Kubernetes its IP), which no certificate names; the service's name is in
# every prefill certificate (mesh/pki.py, the cert-manager component's dnsNames).
KV_HOLDER = "prefill"
RELEASE_TIMEOUT_S = 5.0


def _assembler(handle: kv_cache_pb2.KvHandle) -> kv_codec.KvAssembler | kv_codec.StateAssembler:
    if handle.format.engine == "llama.cpp":
        return kv_codec.StateAssembler(handle.format.state_bytes, handle.num_tokens)
    return kv_codec.KvAssembler(
        handle.num_layers, (handle.num_kv_heads, handle.num_tokens, handle.head_dim), handle.dtype
    )


async def pull(channels: ChannelPool, handle: kv_cache_pb2.KvHandle) -> KvState:
    """The KV `handle` announces (every layer's K and V, or the engine's sequence state);
    NotFound when the lease is gone. The handle is decode's validated one: its sizes are
    what the assembler allocates."""
    stub = kv_cache_pb2_grpc.KvCacheServiceStub(
        channels.get(handle.address, KV_CACHE, server_name=KV_HOLDER)
    )
    assembler = _assembler(handle)
    call = stub.Pull(
        kv_cache_pb2.PullRequest(handle_id=handle.id, max_chunk_bytes=PULL_CHUNK_BYTES)
    )
    try:
        async for response in call:
            if response.HasField("complete"):
                return assembler.finish(response.complete)
            assembler.add(response.chunk)
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.NOT_FOUND:
            raise NotFound(
                f"KV handle {handle.id!r} is unknown or expired at {handle.address}",
                resource_type="kv_handle",
                resource_name=handle.id,
            ) from error
        raise
    raise ValueError("KV stream ended without PullComplete")


class KvReleaser:
    """Fire-and-forget Release calls, each in a task of its own, so that a request being
    cancelled (the usual reason to release early) cannot cancel its own cleanup. If a
    Release is lost anyway, the lease expires."""

    def __init__(self, channels: ChannelPool) -> None:
        self.channels = channels
        self._tasks: set[asyncio.Task[None]] = set()

    def release_later(self, address: str, handle_id: str = "", release_token: str = "") -> None:
        """Frees a KV by its handle's id, or by the release token its Prefill carried."""
        request = kv_cache_pb2.ReleaseRequest(handle_id=handle_id, release_token=release_token)

        async def release() -> None:
            stub = kv_cache_pb2_grpc.KvCacheServiceStub(
                self.channels.get(address, KV_CACHE, server_name=KV_HOLDER)
            )
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Release(request, timeout=RELEASE_TIMEOUT_S)

        task = asyncio.create_task(release())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
