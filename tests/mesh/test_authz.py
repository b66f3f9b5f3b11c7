"""Caller authorization under mutual TLS (mesh/authz.py): the declared allow-lists are the
call graph, and a server refuses a caller outside its method's list with
PERMISSION_DENIED before anything else happens, without the caller's breaker counting it."""

from __future__ import annotations

import importlib
import pkgutil

import grpc
import pytest
from prometheus_client import REGISTRY

import aimesh
from aimesh.llm.v1 import kv_cache_pb2, kv_cache_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from mesh.authz import ANYONE, EDGE, OPERATOR, Policy
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.errors import error_info
from mesh.failures import Conflict, PermissionDenied, Unauthenticated
from mesh.health import probe
from mesh.pki import throwaway_pki
from mesh.registry import discover
from mesh.server import MeshServer
from tests.harness import InProcess

pytestmark = pytest.mark.unit

PULL = "/aimesh.llm.v1.KvCacheService/Pull"
REACHED = "REACHED"


def test_a_method_entry_narrows_its_service_and_undeclared_methods_are_refused():
    policy = Policy([("pkg.Service", ("a", "b")), ("/pkg.Service/Write", ("a",))])
    assert policy.callers_of("/pkg.Service/Read") == {"a", "b"}
    assert policy.callers_of("/pkg.Service/Write") == {"a"}
    assert policy.callers_of("/pkg.Other/Read") == frozenset()
    policy.check("/pkg.Service/Write", frozenset({"a"}), "a")
    with pytest.raises(PermissionDenied) as denied:
        policy.check("/pkg.Service/Write", frozenset({"a"}), "b")
    assert denied.value.metadata == {"caller": "b", "method": "/pkg.Service/Write"}
    with pytest.raises(Unauthenticated):
        policy.check("/pkg.Service/Read", frozenset({ANYONE}), None)
    policy.check("/pkg.Service/Read", frozenset({ANYONE}), "anyone-with-a-certificate")


def _served_names() -> set[str]:
    """Every proto service and method aimesh defines, by full name."""
    names = set()
    for module in pkgutil.walk_packages(aimesh.__path__, "aimesh."):
        if not module.name.endswith("_pb2"):
            continue
        for service in importlib.import_module(module.name).DESCRIPTOR.services_by_name.values():
            names.add(service.full_name)
            names.update(f"/{service.full_name}/{m.name}" for m in service.methods)
    return names


def test_allow_lists_are_the_call_graph_seen_from_the_callee():
    """Each service names exactly the services that declare it a dependency; the edge and
    the operator reach exactly the services the edge exposes; every entry is a real proto
    service or method."""
    specs = discover()
    served = _served_names()
    for callee in specs.values():
        entries = dict(callee.callers)
        named = {name for names in entries.values() for name in names}
        dependents = {s.name for s in specs.values() if callee.name in s.dependencies}
        assert named & specs.keys() == dependents, callee.name
        assert set(entries) <= served, callee.name
        if callee.diagnostic:
            continue
        outside = {EDGE, OPERATOR} & named
        assert outside == ({EDGE, OPERATOR} if callee.edge_services else set()), callee.name
        for proto in callee.edge_services:
            assert {EDGE, OPERATOR} <= set(entries[proto]), proto


class _Reached(prefill_pb2_grpc.PrefillServiceServicer, kv_cache_pb2_grpc.KvCacheServiceServicer):
    """Prefill's two proto services, each method failing with REACHED: a call that gets
    this answer passed authorization."""

    async def Prefill(self, request, context):
        raise Conflict("the handler was reached", reason=REACHED)

    async def Pull(self, request, context):
        raise Conflict("the handler was reached", reason=REACHED)
        yield

    async def Release(self, request, context):
        raise Conflict("the handler was reached", reason=REACHED)


async def _kv_worker(server: MeshServer) -> None:
    reached = _Reached()
    server.add_service(
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server,
        reached,
        prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"],
    )
    server.add_service(
        kv_cache_pb2_grpc.add_KvCacheServiceServicer_to_server,
        reached,
        kv_cache_pb2.DESCRIPTOR.services_by_name["KvCacheService"],
    )


def _reached(error: grpc.aio.AioRpcError) -> bool:
    info = error_info(error)
    return error.code() == grpc.StatusCode.FAILED_PRECONDITION and info.reason == REACHED


async def _code(target: str, settings: MeshSettings, call: str) -> grpc.aio.AioRpcError:
    async with create_channel(target, settings) as channel:
        prefill = prefill_pb2_grpc.PrefillServiceStub(channel)
        kv = kv_cache_pb2_grpc.KvCacheServiceStub(channel)
        handle = "0" * 32
        with pytest.raises(grpc.aio.AioRpcError) as error:
            if call == "Pull":
                async for _ in kv.Pull(kv_cache_pb2.PullRequest(handle_id=handle), timeout=5):
                    pass
            elif call == "Release":
                await kv.Release(kv_cache_pb2.ReleaseRequest(handle_id=handle), timeout=5)
            else:
                await prefill.Prefill(prefill_pb2.PrefillRequest(token_ids=[1]), timeout=5)
        return error.value


async def assert_prefills_allow_list(target: str, as_: dict[str, MeshSettings]) -> None:
    """Only decode pulls KV; the router prefills and releases; the operator reaches
    neither: each refusal PERMISSION_DENIED with CALLER_NOT_ALLOWED naming the caller."""
    allowed = {("decode", "Pull"), ("decode", "Release"), ("generation", "Prefill")}
    allowed.add(("generation", "Release"))
    for caller in ("decode", "generation", OPERATOR):
        for call in ("Pull", "Release", "Prefill"):
            error = await _code(target, as_[caller], call)
            if (caller, call) in allowed:
                assert _reached(error), (caller, call)
                continue
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (caller, call)
            info = error_info(error)
            assert info.reason == "CALLER_NOT_ALLOWED" and info.metadata["caller"] == caller


@pytest.mark.service
async def test_prefill_serves_its_declared_callers_only(tmp_path):
    """Prefill's real allow-list over real mTLS: only decode pulls KV; the router may
    prefill and release but not pull; the operator's certificate reaches neither, though
    health answers every certificate of the CA."""
    pki = throwaway_pki(tmp_path, ["prefill", "decode", "generation", OPERATOR])
    as_ = {name: MeshSettings(tls=tls) for name, tls in pki.items()}
    async with InProcess() as services:
        served = await services.start("prefill", as_["prefill"], setup=_kv_worker)
        target = served.target
        await assert_prefills_allow_list(target, as_)
        assert await probe(target, "prefill", tls=pki[OPERATOR]) == "SERVING"


@pytest.mark.service
async def test_refusals_are_counted_and_never_open_the_callers_breaker(tmp_path):
    """Forty refused Pulls on one mesh channel (a breaker's window is 20): the next
    allowed call still goes through, and every refusal is in the metric."""
    pki = throwaway_pki(tmp_path, ["prefill", "generation"])
    labels = {"grpc_method": PULL, "caller": "generation", "reason": "CALLER_NOT_ALLOWED"}
    before = REGISTRY.get_sample_value("aimesh_authz_refused_total", labels) or 0.0
    async with InProcess() as services:
        served = await services.start("prefill", MeshSettings(tls=pki["prefill"]), setup=_kv_worker)
        async with create_channel(served.target, MeshSettings(tls=pki["generation"])) as channel:
            kv = kv_cache_pb2_grpc.KvCacheServiceStub(channel)
            for _ in range(40):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in kv.Pull(kv_cache_pb2.PullRequest(handle_id="0" * 32)):
                        pass
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.aio.AioRpcError) as allowed:
                await kv.Release(kv_cache_pb2.ReleaseRequest(handle_id="0" * 32), timeout=5)
            assert _reached(allowed.value)
    after = REGISTRY.get_sample_value("aimesh_authz_refused_total", labels)
    assert after - before == 40


@pytest.mark.service
async def test_plaintext_serves_every_caller_as_before(tmp_path):
    """No [tls]: no identities, no allow-lists (the loopback default)."""
    async with InProcess() as services:
        served = await services.start("prefill", setup=_kv_worker)
        assert _reached(await _code(served.target, MeshSettings(), "Pull"))
