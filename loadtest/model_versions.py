"""Model versions under a steady stream: what activate, canary and rollback cost, and what
they cost against the old way (restarting the router on the new version).

One mesh of real processes: a tokenizer, the embedded SmolLM2 in float32 on one
prefill+decode pair (version f32) and in bfloat16 on another (version bf16, whose pair
starts only when the cold start is measured), one generation router following a file
registry. Two callers send a 3-token Generate in a loop, each request from a new user,
through a mesh channel (breaker and retries as a service has them); every change is
timed and the requests it failed counted.

    python -m loadtest.model_versions --rounds 3 --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from aimesh.llm.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    models_pb2,
    models_pb2_grpc,
    sampling_pb2,
)
from loadtest.chaos_mesh import free_port
from loadtest.mesh_overhead import write
from mesh import caller, supervisor
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.deployments import Artifact, FileStore, Version, activate, bucket, register
from mesh.registry import discover
from services.llm.artifacts import resolve_model

MODEL = "chat"
BEGIN, END = "<!-- model-versions:begin -->", "<!-- model-versions:end -->"
GENERATION = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
MODELS = models_pb2.DESCRIPTOR.services_by_name["ModelService"]
CALLERS = 2
CANARY_PERCENT = 30
# A change's failures are the requests that ended from its start to this long after it.
SETTLE_S = 2.0


@dataclass
class Served:
    started: float
    ended: float
    version: str = ""
    error: str = ""


@dataclass
class Change:
    name: str
    how: str
    seconds: float
    started: float
    ended: float
    failed: int = 0
    requests: int = 0


@dataclass
class Stream:
    """CALLERS callers in a loop, every request from a user never seen before."""

    channel: grpc.aio.Channel
    log: list[Served] = field(default_factory=list)
    users: itertools.count = field(default_factory=itertools.count)

    async def run(self, stop: asyncio.Event) -> None:
        stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        request = generation_pb2.GenerateRequest(
            prompt="Hello", model=MODEL, stopping=sampling_pb2.StoppingCriteria(max_new_tokens=3)
        )

        async def one() -> None:
            while not stop.is_set():
                user = f"user-{next(self.users)}"
                started = time.monotonic()
                try:
                    call = stub.Generate(
                        request, metadata=((caller.USER_METADATA_KEY, user),), timeout=60
                    )
                    version = ""
                    async for message in call:
                        if message.HasField("complete"):
                            version = message.complete.model_version
                    self.log.append(Served(started, time.monotonic(), version))
                except grpc.aio.AioRpcError as error:
                    self.log.append(Served(started, time.monotonic(), error=error.code().name))
                    await asyncio.sleep(0.05)  # a refused caller retries, not spins

        await asyncio.gather(*(one() for _ in range(CALLERS)))

    def judge(self, change: Change) -> Change:
        during = [s for s in self.log if change.started <= s.ended <= change.ended + SETTLE_S]
        change.requests = len(during)
        change.failed = sum(bool(s.error) for s in during)
        return change

    async def served_after(self, moment: float, count: int, limit_s: float = 120) -> None:
        deadline = time.monotonic() + limit_s
        while sum(s.started > moment and not s.error for s in self.log) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} requests served in {limit_s} s")
            await asyncio.sleep(0.05)


def _config(root: Path, name: str, ports: dict[str, int], dtype: str, pair: str) -> Path:
    path = root / f"{name}.toml"
    path.write_text(
        f'deployments = "{root / "deployments.json"}"\n'
        f'[engines.llm]\nengine = "torch"\nprefill_engine = "torch"\ndtype = "{dtype}"\n'
        f"[services.tokenizer]\nport = {ports['tokenizer']}\n"
        f'[services.decode]\nprefill = ["127.0.0.1:{ports[f"prefill-{pair}"]}"]\n'
        f'[services.generation]\nprefill = ["127.0.0.1:{ports["prefill-a"]}"]\n'
        f'decode = ["127.0.0.1:{ports["decode-a"]}"]\nregistry_poll_s = 0.5\n'
        f'[services.generation.dependencies]\ntokenizer = "127.0.0.1:{ports["tokenizer"]}"\n'
    )
    return path


class Mesh:
    def __init__(self, root: Path) -> None:
        self.root = root
        names = ["tokenizer", "prefill-a", "decode-a", "prefill-b", "decode-b", "generation"]
        self.ports = {name: free_port() for name in names}
        self.configs = {
            "a": _config(root, "float32", self.ports, "float32", "a"),
            "b": _config(root, "bfloat16", self.ports, "bfloat16", "b"),
        }
        self.children: dict[str, supervisor.Child] = {}
        self.cold_starts: dict[str, float] = {}

    def target(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    async def start(self, *names: str) -> None:
        """Starts each (label = service-pair) and waits until all are ready; records each
        process's cold start (spawn to ready, the warm-up forward included)."""
        specs = discover()
        for name in names:
            service, _, pair = name.partition("-")
            env = {"AIMESH_CONFIG": str(self.configs[pair or "a"]), "OTEL_TRACES_EXPORTER": "none"}
            self.children[name] = await supervisor.start(
                specs[service],
                MeshSettings(),
                self.root / f"{name}.log",
                port=self.ports[name],
                env=env,
            )

        async def ready(name: str) -> None:
            took = await supervisor.wait_ready([self.children[name]], 600)
            (seconds,) = took.values()
            if seconds is None:
                raise RuntimeError(f"{name} did not become ready; see {self.root / name}.log")
            self.cold_starts[name] = seconds

        await asyncio.gather(*(ready(name) for name in names))

    async def stop(self, *names: str) -> None:
        await supervisor.stop([self.children.pop(name) for name in names], 20)

    async def close(self) -> None:
        await supervisor.stop(list(self.children.values()), 20)


def _registry(mesh: Mesh, model_dir: Path) -> FileStore:
    store = FileStore(mesh.root / "deployments.json")
    artifact = Artifact.of(model_dir)
    for name, engine, pair in (("f32", "torch-float32", "a"), ("bf16", "torch-bfloat16", "b")):
        workers = {kind: [mesh.target(f"{kind}-{pair}")] for kind in ("prefill", "decode")}
        version = Version(name=name, artifact=artifact, engine=engine, workers=workers)
        store.update(lambda s, v=version: register(s, MODEL, v, "bench"))
    store.update(lambda s: activate(s, MODEL, "f32", "bench"))
    return store


async def _timed(
    stream: Stream, name: str, how: str, work: Callable[[], Awaitable[object]]
) -> Change:
    started = time.monotonic()
    await work()
    ended = time.monotonic()
    await stream.served_after(ended, CALLERS * 2)
    return stream.judge(Change(name, how, ended - started, started, ended))


def _first_on(stream: Stream, version: str, after: float) -> tuple[float, float] | None:
    """The first request on `version` started after `after`, and the median of the later
    ones (ms): the first served warm is no slower than the rest."""
    served = [s for s in stream.log if s.started > after and s.version == version]
    if len(served) < 3:
        return None
    durations = [(s.ended - s.started) * 1000 for s in served]
    return durations[0], statistics.median(durations[1:])


async def run(rounds: int) -> tuple[list[Change], dict[str, float], list[tuple[float, float]]]:
    model_dir = resolve_model(None, MeshSettings().cache_dir)
    with tempfile.TemporaryDirectory(prefix="aimesh-versions-") as work:
        mesh = Mesh(Path(work))
        _registry(mesh, model_dir)
        changes: list[Change] = []
        firsts: list[tuple[float, float]] = []
        try:
            await mesh.start("tokenizer", "prefill-a", "decode-a", "generation")
            channel = create_channel(
                mesh.target("generation"), MeshSettings(), services=[GENERATION, MODELS]
            )
            async with channel:
                stub = models_pb2_grpc.ModelServiceStub(channel)
                stream, stop = Stream(channel), asyncio.Event()
                running = asyncio.create_task(stream.run(stop))
                try:
                    await stream.served_after(0, 4)

                    def activate_bf16() -> Awaitable[object]:
                        return stub.Activate(
                            models_pb2.ActivateRequest(model=MODEL, version="bf16"), timeout=600
                        )

                    def rollback() -> Awaitable[object]:
                        return stub.Rollback(models_pb2.RollbackRequest(model=MODEL), timeout=600)

                    async def cold() -> None:
                        await mesh.start("prefill-b", "decode-b")
                        await activate_bf16()

                    changes.append(
                        await _timed(
                            stream,
                            "activate bf16, cold",
                            "its prefill+decode started from nothing, then Activate",
                            cold,
                        )
                    )
                    changes.append(await _timed(stream, "rollback to f32", "Rollback", rollback))
                    for _ in range(rounds):
                        change = await _timed(
                            stream,
                            "activate bf16, warm",
                            "Activate; bf16's workers already running",
                            activate_bf16,
                        )
                        changes.append(change)
                        first = _first_on(stream, "bf16", change.ended)
                        if first:
                            firsts.append(first)
                        changes.append(
                            await _timed(stream, "rollback to f32", "Rollback", rollback)
                        )
                    changes.append(
                        await _timed(
                            stream,
                            f"canary bf16 to {CANARY_PERCENT}% of users",
                            "SetCanary",
                            lambda: stub.SetCanary(
                                models_pb2.SetCanaryRequest(
                                    model=MODEL, version="bf16", percent=CANARY_PERCENT
                                ),
                                timeout=600,
                            ),
                        )
                    )
                    changes.append(await _timed(stream, "end the canary", "Rollback", rollback))

                    async def restart() -> None:
                        """The old way: the new version in the config, the router restarted."""
                        await asyncio.to_thread(
                            FileStore(mesh.root / "deployments.json").update,
                            lambda s: activate(s, MODEL, "bf16", "bench"),
                        )
                        await mesh.stop("generation")
                        await mesh.start("generation")

                    changes.append(
                        await _timed(
                            stream,
                            "bf16 by restarting the router",
                            "registry edited, router SIGTERM + start",
                            restart,
                        )
                    )
                finally:
                    stop.set()
                    await running
        finally:
            await mesh.close()
    return changes, mesh.cold_starts, firsts


def report(
    changes: list[Change],
    cold_starts: dict[str, float],
    firsts: list[tuple[float, float]],
    rounds: int,
) -> str:
    share = sum(bucket(f"user-{n}") < CANARY_PERCENT for n in range(10_000)) / 100
    lines = [
        BEGIN,
        "## Model versions: activate, canary and rollback under a steady stream",
        "",
        f"Command: `python -m loadtest.model_versions --rounds {rounds}`"
        f" (`make bench-versions`). Machine: {os.cpu_count()} cores, Python"
        f" {platform.python_version()}. Real processes: tokenizer, SmolLM2-135M float32 on one"
        " prefill+decode pair (version f32), bfloat16 on another (bf16), one generation router"
        f" following a file registry. {CALLERS} callers send a 3-token Generate in a loop, each"
        " request from a new user id, through a mesh channel. Time = the admin call (the"
        " router warms the version, writes the registry, routes); failed = requests that"
        f" ended from the change's start to {SETTLE_S:g} s after it.",
        "",
        "| change | how | time (s) | requests | failed |",
        "|---|---|---|---|---|",
    ]
    for c in changes:
        lines.append(f"| {c.name} | {c.how} | {c.seconds:.2f} | {c.requests} | {c.failed} |")
    warm = [c.seconds for c in changes if c.name == "activate bf16, warm"]
    back = [c.seconds for c in changes if c.name == "rollback to f32"]
    cold = next(c for c in changes if c.name == "activate bf16, cold")
    restart = next(c for c in changes if c.name.endswith("restarting the router"))
    workers = ", ".join(
        f"{name} {seconds:.1f} s" for name, seconds in cold_starts.items() if name.endswith("-b")
    )
    lines += [
        "",
        f"- Cold vs warm start of bf16: {cold.seconds:.1f} s with its workers started from"
        f" nothing (their cold start, process start to the first forward: {workers}) vs a"
        f" median {statistics.median(warm):.2f} s once they run (the router checks the"
        " artifact, runs one warm generation, then routes): warm is"
        f" {cold.seconds / statistics.median(warm):.0f}x faster.",
        f"- Rollback: median {statistics.median(back):.2f} s (the version it returns to is"
        " warmed the same way before a request moves).",
        f"- Requests failed by activate, canary and rollback: {sum(c.failed for c in changes[:-1])}"
        f" of {sum(c.requests for c in changes[:-1])}; by the router restart:"
        f" {restart.failed} of {restart.requests}, {restart.seconds:.1f} s without a router.",
    ]
    if firsts:
        lines.append(
            "- The first request on bf16 after a warm activate took"
            f" {statistics.median(f[0] for f in firsts):.0f} ms (median over rounds) vs"
            f" {statistics.median(f[1] for f in firsts):.0f} ms for the ones after it."
        )
    lines += [
        f"- Canary split: {share:.2f}% of 10,000 user ids fall below {CANARY_PERCENT}"
        " (sha256(user id) % 100, the same on every router replica).",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    changes, cold_starts, firsts = asyncio.run(run(args.rounds))
    markdown = report(changes, cold_starts, firsts, args.rounds)
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
