"""ModelService: the registry as the router serves it, and the admin calls that change it.

A change is made in three steps, so that no request meets a version that cannot serve:
this router warms the target version (Versions.prepare), writes the change to the
registry (an audited event naming the caller), and routes by it; other router replicas
see the new revision at their next look and warm it themselves before they route by it.
The rule that rolls a failing canary back by itself lives here too (`guard_canaries`):
it is the registry's other writer.

Where a version's artifact lies on the servers is for operators: ListModels and GetModel
name it (ModelVersion.artifact_path) to a caller from inside the mesh (`aimesh models`
against the router; the mesh's own authorization admits only the edge and operators to
ModelService) and, through the edge, to a key with the admin scope. A key that may only
read gets every other field, the artifact's sha256 included, and an empty path. The
edge's authorizer says which scopes a key holds (`x-aimesh-scopes`, which Envoy sets on
every request it forwards, over whatever the client sent); a call without it did not
come through the edge.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable

import grpc

from aimesh.llm.v1 import models_pb2, models_pb2_grpc
from mesh import caller, deployments
from mesh.authz import peer_identity
from mesh.deployments import (
    Deployment,
    Event,
    RegistryInvalid,
    RegistryState,
    RegistryUnreachable,
)
from mesh.failures import Conflict, NotFound, NotReady
from mesh.rpc import incoming
from mesh.validation import Violations
from services.generation.canary_rule import CanaryRule
from services.generation.versions import Versions
from services.llm import metrics

log = logging.getLogger(__name__)

MODELS = models_pb2.DESCRIPTOR.services_by_name["ModelService"]
MAX_REASON_BYTES = 1024
RULE_ACTOR = "aimesh-router (canary rule)"
# What the edge's authorizer sends upstream (mesh/edge/authorizer.py SCOPES_HEADER; not
# imported: the router does not load the edge's web server) and the scope that may see
# where artifacts lie.
SCOPES_METADATA_KEY = "x-aimesh-scopes"
MAX_SCOPES_LENGTH = 256
PATHS_SCOPE = "admin"


def _name(violations: Violations, value: str, field: str) -> None:
    violations.check(
        re.fullmatch(deployments.NAME_PATTERN, value) is not None,
        field,
        "must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
    )


def may_see_paths(context: grpc.aio.ServicerContext) -> bool:
    """Whether the caller may see where artifacts lie: from inside the mesh (no scopes
    from the edge), or through the edge with the admin scope."""
    scopes = incoming(context, SCOPES_METADATA_KEY, MAX_SCOPES_LENGTH)
    return scopes is None or PATHS_SCOPE in scopes.split(",")


def _version_message(
    deployment: Deployment, name: str, state: str, paths: bool
) -> models_pb2.ModelVersion:
    version = deployment.versions[name]
    artifact = version.artifact
    return models_pb2.ModelVersion(
        name=name,
        engine=version.engine,
        artifact_sha256=artifact.sha256 if artifact else "",
        artifact_path=str(artifact.path) if artifact and paths else "",
        capabilities={key: str(value) for key, value in version.capabilities.items()},
        workers={kind: models_pb2.Workers(targets=t) for kind, t in version.workers.items()},
        state=state,
    )


def _event_message(event: Event, applied_s: float = 0.0) -> models_pb2.ModelEvent:
    return models_pb2.ModelEvent(
        seq=event.seq,
        at=event.at,
        actor=event.actor,
        model=event.model,
        action=event.action,
        before=event.before or "",
        after=event.after or "",
        reason=event.reason,
        applied_s=applied_s,
    )


class ModelServicer(models_pb2_grpc.ModelServiceServicer):
    # Set by the router's warm-up with the router's own (MeshServer answers every call
    # NOT_READY until it has run).
    versions: Versions

    def _model_message(self, deployment: Deployment, paths: bool) -> models_pb2.Model:
        def state(version: str) -> str:
            pool = self.versions.pools.get((deployment.model, version))
            if pool is None:
                return ""
            return "draining" if pool.draining else "serving"

        return models_pb2.Model(
            name=deployment.model,
            active=deployment.active or "",
            versions=[
                _version_message(deployment, v, state(v), paths) for v in deployment.versions
            ],
            canary=(
                models_pb2.Canary(
                    version=deployment.canary.version, percent=deployment.canary.percent
                )
                if deployment.canary
                else None
            ),
            previous=deployment.previous,
        )

    def _models(self, state: RegistryState, paths: bool) -> list[models_pb2.Model]:
        found = [self._model_message(d, paths) for d in state.deployments.values()]
        if self.versions.own.model not in state.deployments:
            found.insert(0, models_pb2.Model(name=self.versions.own.model))
        return found

    async def _registry(self, paths: bool) -> RegistryState:
        """The registry now. Why it cannot be read names where it is kept: said only to
        whoever may see paths; others hear that it cannot be read."""
        try:
            return await self.versions.load()
        except (RegistryInvalid, RegistryUnreachable) as failure:
            if paths:
                raise
            said = "the model registry cannot be read now; the router serves its last valid table"
            raise type(failure)(said) from None

    async def ListModels(
        self, request: models_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.ListModelsResponse:
        paths = may_see_paths(context)
        models = self._models(await self._registry(paths), paths)
        return models_pb2.ListModelsResponse(models=models)

    async def GetModel(
        self, request: models_pb2.GetModelRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.GetModelResponse:
        violations = Violations()
        _name(violations, request.model, "model")
        violations.raise_if_any()
        paths = may_see_paths(context)
        for model in self._models(await self._registry(paths), paths):
            if model.name == request.model:
                return models_pb2.GetModelResponse(model=model)
        raise NotFound(
            f"no model {request.model!r}", resource_type="model", resource_name=request.model
        )

    async def _change(
        self,
        context: grpc.aio.ServicerContext,
        model: str,
        warm: Callable[[Deployment], str | None],
        change: Callable[[RegistryState, str], Event],
    ) -> models_pb2.ModelEvent:
        """Warms the version `warm` names (None: the change needs none), makes the change
        in the registry, and routes by it."""
        started = time.perf_counter()
        state = await self.versions.load()
        deployment = state.deployment(model)
        target = warm(deployment)
        if target is not None:
            await self.versions.prepare(deployment, target)
        actor = _actor(context)
        event = await asyncio.to_thread(self.versions.store.update, lambda s: change(s, actor))
        await self.versions.look()
        log.info(
            "model registry changed",
            extra={"model": model, "action": event.action, "actor": actor, "after": event.after},
        )
        return _event_message(event, time.perf_counter() - started)

    async def Activate(
        self, request: models_pb2.ActivateRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.ActivateResponse:
        violations = Violations()
        _name(violations, request.model, "model")
        _name(violations, request.version, "version")
        violations.max_length(request.reason.encode(), "reason", MAX_REASON_BYTES)
        violations.raise_if_any()

        def warm(deployment: Deployment) -> str:
            deployments.known_version(deployment, request.version)
            return request.version

        event = await self._change(
            context,
            request.model,
            warm,
            lambda s, actor: deployments.activate(
                s, request.model, request.version, actor, request.reason
            ),
        )
        return models_pb2.ActivateResponse(event=event)

    async def SetCanary(
        self, request: models_pb2.SetCanaryRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.SetCanaryResponse:
        violations = Violations()
        _name(violations, request.model, "model")
        _name(violations, request.version, "version")
        violations.in_range(request.percent, "percent", 0, 100)
        violations.max_length(request.reason.encode(), "reason", MAX_REASON_BYTES)
        violations.raise_if_any()

        def warm(deployment: Deployment) -> str | None:
            deployments.known_version(deployment, request.version)
            return request.version if request.percent else None

        event = await self._change(
            context,
            request.model,
            warm,
            lambda s, actor: deployments.set_canary(
                s, request.model, request.version, request.percent, actor, request.reason
            ),
        )
        return models_pb2.SetCanaryResponse(event=event)

    async def Rollback(
        self, request: models_pb2.RollbackRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.RollbackResponse:
        violations = Violations()
        _name(violations, request.model, "model")
        violations.max_length(request.reason.encode(), "reason", MAX_REASON_BYTES)
        violations.raise_if_any()

        def warm(deployment: Deployment) -> str | None:
            # Ending a canary leaves the active version, which is warm; returning to the
            # version before must find it warm first.
            if deployment.canary is None and deployment.previous:
                return deployment.previous[-1]
            return None

        event = await self._change(
            context,
            request.model,
            warm,
            lambda s, actor: deployments.rollback(s, request.model, actor, request.reason),
        )
        return models_pb2.RollbackResponse(event=event)


def _actor(context: grpc.aio.ServicerContext) -> str:
    """Who asked, for the audit trail: the edge's tenant, else the mesh caller's name."""
    tenant = caller.current()
    if tenant:
        return f"tenant:{tenant}"
    return peer_identity(context) or "mesh"


async def guard_canaries(versions: Versions, rule: CanaryRule, interval_s: float) -> None:
    """Judges every canary this router serves each `interval_s`, and rolls back the ones
    the rule condemns (a background task; the server watches it)."""
    while True:
        await asyncio.sleep(interval_s)
        for model, deployment in list(versions.serving.items()):
            canary = deployment.canary
            if canary is None or deployment.active is None:
                continue
            verdict = rule.verdict(model, deployment.active, canary.version)
            if verdict is None:
                continue
            try:
                await asyncio.to_thread(
                    versions.store.update,
                    lambda s, m=model, v=canary.version, why=verdict.reason: deployments.end_canary(
                        s, m, v, RULE_ACTOR, why
                    ),
                )
            except (Conflict, NotReady):
                # Another replica (or a person) changed it first; or the registry cannot
                # be written now (the follower says so): judged again at the next look.
                continue
            metrics.CANARY_ROLLBACKS.labels(model, canary.version, verdict.signal).inc()
            rule.forget(model, canary.version)
            log.warning(
                "canary rolled back by the rule",
                extra={"model": model, "version": canary.version, "reason": verdict.reason},
            )
            await versions.look()
