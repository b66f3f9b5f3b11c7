"""Which model version serves a request, following the registry (mesh/deployments.py).

The router keeps a *serving table*: for each registered model, the deployment (active
version, canary) it routes by. A new look at the registry replaces a model's entry only
after every version it names has a warm Pool: its workers answer, serve the registered
artifact (GetInfo's sha256) and ran one generation. Until then requests keep going to the
versions they went to, so a change never sends a request to a version that cannot serve.
A version no deployment names any more drains: it takes no new request, and its channels
close once the requests already on it have finished.

A version without workers of its own is served by the router's own (the workers
[services.generation] names), so registering the model a mesh already runs costs nothing.
The mesh's own model answers by its name (or an empty `model`) even when unregistered.

Bringing a version in is a warm start: the router's process, its channels to workers
that already serve another version, and any tokenizer it already holds (by the sha256
of tokenizer.json) are reused; the version's weights load in its own workers, whose cold
start (process start to first forward) is aimesh_cold_start_seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from aimesh.llm.v1 import sampling_pb2
from mesh.artifacts import sha256_of
from mesh.client import ChannelPool
from mesh.deployments import (
    Deployment,
    RegistryInvalid,
    RegistryState,
    RegistryUnreachable,
    Store,
    Version,
)
from mesh.failures import Conflict, NotReady
from mesh.health import probe
from mesh.info import get_info
from mesh.store_health import StoreHealth
from mesh.tls import TlsSettings
from services.generation.logprobs import TokenPieces, pieces_of
from services.generation.pipeline import Outcome, Pipeline
from services.generation.tokenize import TOKENIZER, TokenizerClient
from services.generation.workers import DecodePicker, PrefillPicker
from services.llm import metrics
from services.llm.artifacts import load_tokenizer
from services.llm.requests import Stopping

log = logging.getLogger(__name__)

WARM_PROMPT = "Hello"


class RegistryMissing(RegistryInvalid):
    """The registry's store answers with no document after it held one."""


@dataclass(eq=False)
class Pool:
    """What serves one version here: its engine, its tokenizers, and the requests on it."""

    model: str
    version: str
    engine: object  # services.generation.servicer.Engine (a Pipeline, or Triton)
    tokenizer: TokenizerClient
    text_tokenizer: Tokenizer
    # A version on workers of its own: its load poll, started once the workers answer.
    decode_picker: DecodePicker | None = None
    poll_task: asyncio.Task[None] | None = None
    in_flight: int = 0
    draining: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    # Each token's bytes and text, for logprobs.
    pieces: TokenPieces = field(init=False)

    def __post_init__(self) -> None:
        self.pieces = pieces_of(self.text_tokenizer)

    def enter(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    async def close(self) -> None:
        if self.decode_picker is not None:
            await self.decode_picker.stop()


@dataclass(frozen=True)
class Route:
    """Where one request runs: a model, a version ("" = the router's own, unregistered
    model) and the pool that serves it."""

    model: str
    version: str
    pool: Pool


class Versions:
    """The serving table, the pools it routes to, and the work of changing them."""

    def __init__(
        self,
        *,
        store: Store,
        own: Pool,
        channels: ChannelPool,
        tls: TlsSettings | None,
        poll_interval_s: float,
        warm_timeout_s: float,
        warm_up: Callable[[Pool], Awaitable[None]],
        watch: Callable[[asyncio.Task[None]], None],
        unwatch: Callable[[asyncio.Task[None]], None],
        tokenizers: dict[str, Tokenizer] | None = None,
        on_applied: Callable[[], None] = lambda: None,
        health: StoreHealth | None = None,
    ) -> None:
        self.store = store
        self.own = own
        self.channels = channels
        self.tls = tls
        self.poll_interval_s = poll_interval_s
        self.warm_timeout_s = warm_timeout_s
        self._warm_up = warm_up
        self._watch = watch
        self._unwatch = unwatch
        self._on_applied = on_applied
        self.health = health or StoreHealth("registry")
        self._refused: set[str] = set()
        # Loaded tokenizers by the sha256 of their tokenizer.json: a version whose
        # vocabulary the router already holds does not load it again.
        self.tokenizers = dict(tokenizers or {})
        self.serving: dict[str, Deployment] = {}
        self.state = RegistryState()
        self.pools: dict[tuple[str, str], Pool] = {}
        self._change = asyncio.Lock()
        self._drains: set[asyncio.Task[None]] = set()

    # Routing

    def models(self) -> list[str]:
        """Every name a request may ask for: the mesh's own model and the registered."""
        return list(dict.fromkeys([self.own.model, *self.serving]))

    def knows(self, model: str) -> bool:
        return not model or model == self.own.model or model in self.serving

    def route(self, model: str, user: str) -> Route:
        """The version `user` runs on for `model` (empty: the mesh's own model), which
        `knows`."""
        name = model or self.own.model
        deployment = self.serving.get(name)
        if deployment is None:
            return Route(name, "", self.own)
        version = deployment.version_for(user or None)
        return Route(name, version, self.pools[(name, version)])

    @contextlib.contextmanager
    def running(self, route: Route) -> Iterator[Pool]:
        """Counts a request on its pool while it runs: a draining pool closes after it."""
        route.pool.enter()
        try:
            yield route.pool
        finally:
            route.pool.leave()

    # Following the registry

    async def load(self) -> RegistryState:
        """The registry now; RegistryUnreachable or RegistryInvalid when it cannot be had."""
        return await asyncio.to_thread(self.store.load)

    async def look(self) -> bool:
        """One look at the registry: a new valid revision is applied; a store that does
        not answer, or answers with a document that is not a registry, leaves the table
        served as it is (the last valid one, as Envoy keeps its last good config when an
        update fails validation), reported by `health`. True when the registry was read.
        Never raises: nothing the registry holds may end the router."""
        try:
            state = await self.load()
            if state.revision == 0 and self.state.revision > 0:
                raise RegistryMissing(
                    f"the registry holds no document any more (it held revision "
                    f"{self.state.revision}): its store lost it or was replaced; serving "
                    "that revision until one is written"
                )
        except RegistryUnreachable as error:
            await self.health.failed("unreachable", error)
            return False
        except (RegistryInvalid, RegistryMissing) as error:
            await self.health.failed("invalid", error)
            return False
        except Exception as error:  # a fault of ours: said, and the table kept all the same
            log.exception("registry look failed")
            await self.health.failed("error", error)
            return False
        await self.health.succeeded()
        if state.revision != self.state.revision:
            try:
                self._said_refused(await self.apply(state))
            except Exception:  # a fault of ours: said; the next look tries again
                log.exception("registry change not applied", extra={"revision": state.revision})
        return True

    async def follow(self) -> None:
        """Looks at the registry every poll_interval_s, and after a failed look again
        after the health's backoff (a background task; the server watches it, and it
        never ends on its own)."""
        while True:
            read = await self.look()
            await asyncio.sleep(self.poll_interval_s if read else self.health.retry_in())

    def _said_refused(self, refused: list[str]) -> None:
        """Logs why models stay where they are, once per distinct reason (the change is
        tried again at every look until it can be made)."""
        for refusal in refused:
            if refusal not in self._refused:
                log.warning("registry change not applied yet: %s", refusal)
        self._refused = set(refused)

    async def apply(self, state: RegistryState) -> list[str]:
        """Routes by `state`, model by model, once each version it names is warm; says
        why each model it could not move yet stays where it is."""
        async with self._change:
            refused: list[str] = []
            for name, deployment in state.deployments.items():
                if deployment.active is None:
                    continue
                wanted = [deployment.active]
                if deployment.canary is not None:
                    wanted.append(deployment.canary.version)
                try:
                    for version in wanted:
                        await self._prepared(deployment, version)
                except (Conflict, NotReady) as refusal:
                    refused.append(f"{name}: {refusal}")
                    continue
                except Exception as error:  # its warm-up failed: the model stays where it is
                    said = str(error).splitlines()[0] if str(error) else ""
                    refused.append(f"{name}: {type(error).__name__}: {said[:300]}")
                    continue
                self.serving[name] = deployment
            self._drain_unused()
            self._on_applied()
            if not refused:
                self.state = state
            return refused

    async def prepare(self, deployment: Deployment, version: str) -> float:
        """Makes `version` warm here before a change routes to it; seconds it took."""
        started = time.perf_counter()
        async with self._change:
            await self._prepared(deployment, version)
        return time.perf_counter() - started

    async def _prepared(self, deployment: Deployment, version_name: str) -> Pool:
        key = (deployment.model, version_name)
        pool = self.pools.get(key)
        if pool is not None and not pool.draining:
            return pool
        version = deployment.versions[version_name]
        started = time.perf_counter()
        pool = await self._open(deployment.model, version)
        try:
            await asyncio.wait_for(self._check(pool, version), self.warm_timeout_s)
        except BaseException as error:
            await self._close(pool)
            if isinstance(error, TimeoutError):
                raise NotReady(
                    f"version {version_name!r} of {deployment.model!r} was not ready within "
                    f"{self.warm_timeout_s:.0f} s"
                ) from None
            raise
        metrics.VERSION_WARM_START.labels(deployment.model, version_name).observe(
            time.perf_counter() - started
        )
        old = self.pools.get(key)
        self.pools[key] = pool
        if old is not None:
            self._drain(old)
        return pool

    async def _open(self, model: str, version: Version) -> Pool:
        """A pool on the version's workers; the router's own where it names none."""
        prefill = version.workers.get("prefill", [])
        decode = version.workers.get("decode", [])
        if not prefill and not decode:
            return Pool(
                model, version.name, self.own.engine, self.own.tokenizer, self.own.text_tokenizer
            )
        if not prefill or not decode:
            raise Conflict(f"version {version.name!r} names prefill or decode workers, not both")
        decode_picker = DecodePicker(decode, self.channels, self.poll_interval_s, self.tls)
        engine = Pipeline(self.channels, PrefillPicker(prefill, self.channels), decode_picker)
        tokenizer_targets = version.workers.get("tokenizer", [])
        tokenizer = (
            TokenizerClient(self.channels.get(tokenizer_targets[0], TOKENIZER))
            if tokenizer_targets
            else self.own.tokenizer
        )
        directory = version.artifact.path if version.artifact else None
        text_tokenizer = self.own.text_tokenizer
        if directory is not None and (directory / "tokenizer.json").is_file():
            text_tokenizer = await self._tokenizer(Path(directory))
        return Pool(model, version.name, engine, tokenizer, text_tokenizer, decode_picker)

    async def _tokenizer(self, directory: Path) -> Tokenizer:
        digest = await asyncio.to_thread(sha256_of, directory / "tokenizer.json")
        if digest not in self.tokenizers:
            self.tokenizers[digest] = await asyncio.to_thread(load_tokenizer, directory)
        return self.tokenizers[digest]

    async def _check(self, pool: Pool, version: Version) -> None:
        """Ready to take traffic: the version's artifact is what was registered (its
        size and sha256 now: a file changed or deleted since is refused, whoever serves
        it), every worker of its own answers SERVING and serves that artifact, and one
        generation ran through the pool."""
        if version.artifact is not None:
            await asyncio.to_thread(version.artifact.verify)
        targets = [t for kind in ("prefill", "decode") for t in version.workers.get(kind, [])]
        for target in targets:
            # A remote process: no local event to wait on.
            while await probe(target, tls=self.tls) != "SERVING":  # noqa: ASYNC110
                await asyncio.sleep(self.poll_interval_s)
            if version.artifact is None:
                continue
            info = await get_info(target, tls=self.tls)
            served = {m.sha256 for m in info.models} if info is not None else set()
            if version.artifact.sha256 not in served:
                raise Conflict(
                    f"worker {target} does not serve the artifact version {version.name!r} "
                    f"registered (sha256 {version.artifact.sha256[:12]}..., it serves "
                    f"{sorted(s[:12] for s in served)})"
                )
        if pool.decode_picker is not None:
            await pool.decode_picker.poll()
            pool.poll_task = pool.decode_picker.start()
            self._watch(pool.poll_task)
        await self._warm_up(pool)

    def _drain_unused(self) -> None:
        used = {(name, d.active) for name, d in self.serving.items()} | {
            (name, d.canary.version) for name, d in self.serving.items() if d.canary is not None
        }
        for key, pool in list(self.pools.items()):
            if key not in used:
                del self.pools[key]
                self._drain(pool)

    def _drain(self, pool: Pool) -> None:
        pool.draining = True
        if pool.in_flight == 0:
            pool.idle.set()
        task = asyncio.create_task(self._close_when_idle(pool), name="version-drain")
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _close_when_idle(self, pool: Pool) -> None:
        await pool.idle.wait()
        await self._close(pool)
        log.info("version drained", extra={"model": pool.model, "version": pool.version})

    async def close(self) -> None:
        for task in list(self._drains):
            task.cancel()
        for pool in self.pools.values():
            await self._close(pool)

    async def _close(self, pool: Pool) -> None:
        """Ends a pool's load poll on purpose: the server must not take it for a fault."""
        if pool.poll_task is not None:
            self._unwatch(pool.poll_task)
        await pool.close()


def warm_stopping() -> Stopping:
    return Stopping(max_new_tokens=2, stop_sequences=(), ignore_eos=True)


async def warm_generation(pool: Pool, request_id: str) -> None:
    """One short generation through the pool's tokenizer, prefill and decode: the first
    real request then finds every connection open and every kernel run once."""
    ids = await pool.tokenizer.tokenize(WARM_PROMPT, request_id)
    engine: Pipeline = pool.engine  # type: ignore[assignment]
    sampling = sampling_pb2.SamplingParameters()
    async with engine.choices(request_id, ids, sampling, warm_stopping(), [Outcome()]) as (stream,):
        async for _ in stream:
            pass
