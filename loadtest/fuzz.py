"""Fuzzing the mesh: every RPC of every service, generated requests, one running mesh.

The RPCs are what each server says it serves (gRPC reflection ListServices on its port),
their request types the generated descriptors under gen/aimesh. Each call's requests come
from loadtest.fuzz_messages, seeded by (seed, call index): hypothesis-style edge cases, a
tenth of them raw garbage bytes; client streams send 1-3 messages, response streams are
read to the end or cut after MAX_STREAM_MESSAGES. Calls go round robin over the RPCs
(each cycle shuffled), so a run cut short by --seconds still covered every RPC.

A request must never take a shared part of the mesh down, so besides the status codes
the run counts: INTERNAL/UNKNOWN answers (the server blamed itself: goal 0; echo's
statuses asked for in the request do not count), health checks that failed (liveness ""
and readiness NAME on every service every 0.5 s, 1 s timeout, from a thread of their
own so the fuzzer's own work cannot delay them: goal 0) and crashes (the process
listening on a service's port went away or changed: goal 0). It exits 1 unless all are 0.

A service whose gRPC side is only the runtime's (the gateway: health and GetInfo beside
its OpenAI-compatible HTTP API, which this does not fuzz) has no RPC to call; its health
checks and its process are watched like every other service's.

Without --target it starts the whole mesh with `aimesh up` on free ports (a knowledge
store of its own, diffusion with the digits model only, the gateway's HTTP API on a free
port too), logs under var/fuzz/<time>/;
every INTERNAL/UNKNOWN is printed with its request and the services' error lines for its
request id, and written to findings.jsonl there, which --replay sends again. The ERROR
lines the services logged meanwhile are counted and listed too (not a goal-0 number:
some are expected, but each is worth a look).

    python -m loadtest.fuzz --calls 3000 --seconds 600 --out docs/benchmarks.md
    python -m loadtest.fuzz --replay var/fuzz/<time>/findings.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import importlib
import itertools
import json
import os
import pkgutil
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
from google.protobuf import descriptor_pool, text_format
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import aimesh
from loadtest.fuzz_messages import WORDS, Inputs
from loadtest.mesh_overhead import write
from mesh.health import wait_until_serving
from mesh.registry import discover
from mesh.rpc import INFRASTRUCTURE_SERVICES

BEGIN, END = "<!-- fuzz:begin -->", "<!-- fuzz:end -->"
BAD_CODES = ("INTERNAL", "UNKNOWN")
ADDRESS = re.compile(r"0x[0-9a-f]+")  # object addresses make equal log lines distinct
ASKED_FOR = "REQUESTED_BY_CALLER"  # echo's response_status: the caller chose the code
GARBAGE_SHARE = 0.1
MAX_STREAM_MESSAGES = 50
HEALTH_INTERVAL_S = 0.5
HEALTH_TIMEOUT_S = 1.0
LISTENER_CHECK_EVERY = 4  # health rounds between looks at the processes on the ports
SERVING = health_pb2.HealthCheckResponse.SERVING
ServingStatus = health_pb2.HealthCheckResponse.ServingStatus
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
KINDS = {
    (False, False): "unary",
    (False, True): "server stream",
    (True, False): "client stream",
    (True, True): "bidi stream",
}
# Header values a caller controls that the mesh's interceptors parse.
HEADERS = (
    ("traceparent", ""),
    ("traceparent", "garbage"),
    ("traceparent", f"00-{'0' * 32}-{'0' * 16}-01"),
    ("traceparent", f"ff-{'f' * 32}-{'f' * 16}-ff"),
    ("traceparent", f"00-{'a' * 32}-{'b' * 16}-01-extra"),
    ("traceparent", "x" * 4000),
    ("tracestate", "=,=" * 500),
    ("baggage", "k=" + "v" * 4000),
)


@dataclass(frozen=True)
class Rpc:
    service: str  # the aimesh service serving it
    target: str
    method: MethodDescriptor

    @property
    def path(self) -> str:
        return f"/{self.method.containing_service.full_name}/{self.method.name}"

    @property
    def kind(self) -> str:
        return KINDS[(self.method.client_streaming, self.method.server_streaming)]


@dataclass
class Finding:
    """One INTERNAL/UNKNOWN: what was sent (base64, replayable) and what came back."""

    index: int
    service: str
    path: str
    code: str
    details: str
    reason: str
    request_id: str
    requests: list[bytes]
    shown: str
    logs: list[str] = field(default_factory=list)

    def as_json(self) -> str:
        data = {**self.__dict__, "requests": [base64.b64encode(r).decode() for r in self.requests]}
        return json.dumps(data, ensure_ascii=False)

    def describe(self) -> str:
        lines = [
            f"{self.code} {self.service} {self.path} (call {self.index}, "
            f"x-request-id {self.request_id}): {self.details!r} reason={self.reason!r}",
            f"  request: {self.shown}",
        ]
        return "\n".join(lines + [f"  log: {line}" for line in self.logs])


@dataclass
class Report:
    seed: int
    concurrency: int
    deadline_s: float
    codes: dict[Rpc, Counter[str]]
    examples: dict[tuple[Rpc, str], str]  # the first details seen for each code
    findings: list[Finding]
    health_checks: int
    health_failures: list[str]
    crashes: list[str]
    logged_errors: Counter[str]  # ERROR lines in the services' logs, when they were read
    seconds: float

    @property
    def made(self) -> int:
        return sum(sum(c.values()) for c in self.codes.values())

    @property
    def ok(self) -> bool:
        return not (self.findings or self.health_failures or self.crashes)

    def bad(self, rpc: Rpc) -> int:
        return sum(self.codes[rpc][code] for code in BAD_CODES)

    def markdown(self, command: str) -> str:
        lines = [
            BEGIN,
            "## Fuzzing the mesh",
            "",
            f"Command: `{command}` (`make fuzz`), seed {self.seed}. Every RPC of every service"
            " of one `aimesh up` (each its own process, 127.0.0.1), requests generated from"
            " the descriptors (edge-case strings, numbers, enums, lists, maps, oneofs, deep"
            f" Structs; {GARBAGE_SHARE:.0%} raw garbage bytes), {self.made} calls in"
            f" {self.seconds:.0f} s, {self.concurrency} at a time, {self.deadline_s:g} s"
            " deadline each. INTERNAL/UNKNOWN is the goal-0 column; `(asked)` marks a status"
            " the request asked echo for.",
            "",
            "| service | method | kind | calls | codes | INTERNAL/UNKNOWN |",
            "|---|---|---|---|---|---|",
        ]
        for rpc, codes in self.codes.items():
            seen = ", ".join(f"{code} {count}" for code, count in codes.most_common())
            lines.append(
                f"| {rpc.service} | {rpc.method.containing_service.name}.{rpc.method.name} |"
                f" {rpc.kind} | {sum(codes.values())} | {seen} | {self.bad(rpc)} |"
            )
        lines += [
            f"| **all** | {len(self.codes)} RPCs | | {self.made} | |"
            f" {sum(self.bad(rpc) for rpc in self.codes)} |",
            "",
            f"Crashes: {len(self.crashes)}. Health checks failed: {len(self.health_failures)}"
            f" of {self.health_checks}. ERROR lines in the services' logs:"
            f" {sum(self.logged_errors.values())}.",
            END,
        ]
        return "\n".join(lines)


def load_generated_code() -> None:
    """Imports every *_pb2 module under gen/aimesh, so the default descriptor pool knows
    every service a server can name."""
    for module in pkgutil.walk_packages(aimesh.__path__, "aimesh."):
        if module.name.endswith("_pb2"):
            importlib.import_module(module.name)


async def served_services(target: str) -> list[str]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for response in stub.ServerReflectionInfo(iter([request]), timeout=10):
            return [s.name for s in response.list_services_response.service]
    return []


async def discover_rpcs(targets: dict[str, str]) -> list[Rpc]:
    """Every method of every proto service each target serves; one that this checkout
    has no generated code for is an error, not a skip."""
    load_generated_code()
    pool = descriptor_pool.Default()
    rpcs = []
    for name, target in targets.items():
        for service in await served_services(target):
            if service in INFRASTRUCTURE_SERVICES:
                continue
            methods = pool.FindServiceByName(service).methods
            rpcs += [Rpc(name, target, method) for method in methods]
    return rpcs


def _same(data: bytes) -> bytes:
    return data


def _reason(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == "grpc-status-details-bin":
            for detail in status_pb2.Status.FromString(value).details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info.reason
    return ""


class Channels:
    """An aio and a sync channel per target. Calls that stream requests go over the sync
    one: when a server ends such a call while the client still writes, grpc.aio's client
    replaces the server's status with an INTERNAL "Internal error from Core" of its own
    (a failed send batch; grpc/grpc#36066, fix proposed in grpc/grpc#43486); the sync
    client keeps the status the server sent."""

    def __init__(self, targets: dict[str, str]) -> None:
        self.aio = {
            t: grpc.aio.insecure_channel(t, options=CHANNEL_OPTIONS) for t in targets.values()
        }
        self.sync = {t: grpc.insecure_channel(t, options=CHANNEL_OPTIONS) for t in targets.values()}

    async def close(self) -> None:
        for channel in self.aio.values():
            await channel.close()
        for channel in self.sync.values():
            channel.close()


def _stub(channel: grpc.Channel | grpc.aio.Channel, rpc: Rpc) -> Callable[..., Any]:
    method = rpc.method
    arity = ("stream" if method.client_streaming else "unary") + "_"
    arity += "stream" if method.server_streaming else "unary"
    parse = GetMessageClass(method.output_type).FromString
    return getattr(channel, arity)(rpc.path, request_serializer=_same, response_deserializer=parse)


async def call(
    channels: Channels,
    rpc: Rpc,
    requests: list[bytes],
    deadline_s: float,
    metadata: tuple[tuple[str, str], ...],
) -> tuple[str, str, str]:
    """Sends serialized requests as they are: (code, details, ErrorInfo reason). Response
    streams are read to the end or cut (cancelled) after MAX_STREAM_MESSAGES."""
    if rpc.method.client_streaming:
        stub = _stub(channels.sync[rpc.target], rpc)
        return await asyncio.to_thread(_call_sync, stub, rpc, requests, deadline_s, metadata)
    stub = _stub(channels.aio[rpc.target], rpc)
    try:
        answer = stub(requests[0], timeout=deadline_s, metadata=metadata)
        if not rpc.method.server_streaming:
            await answer
            return "OK", "", ""
        received = 0
        async for _ in answer:
            received += 1
            if received >= MAX_STREAM_MESSAGES:
                answer.cancel()
                break
    except grpc.aio.AioRpcError as error:
        return error.code().name, error.details() or "", _reason(error.trailing_metadata())
    return "OK", "", ""


def _call_sync(
    stub: Callable[..., Any],
    rpc: Rpc,
    requests: list[bytes],
    deadline_s: float,
    metadata: tuple[tuple[str, str], ...],
) -> tuple[str, str, str]:
    try:
        answer = stub(iter(requests), timeout=deadline_s, metadata=metadata)
        if rpc.method.server_streaming:
            for received, _ in enumerate(answer, 1):
                if received >= MAX_STREAM_MESSAGES:
                    answer.cancel()
                    break
    except grpc.RpcError as error:
        return error.code().name, error.details() or "", _reason(error.trailing_metadata())
    return "OK", "", ""


def generate(rpc: Rpc, seed: int, index: int, words: tuple[str, ...]) -> list[bytes]:
    """The requests of call `index`: the same for the same seed, whatever ran before."""
    rng = random.Random(f"{seed}:{index}")
    inputs = Inputs(rng, words)
    count = rng.randint(1, 3) if rpc.method.client_streaming else 1
    requests = [inputs.message(rpc.method.input_type).SerializeToString() for _ in range(count)]
    if rng.random() < GARBAGE_SHARE:
        requests[rng.randrange(count)] = inputs.garbage(rpc.method.input_type)
    return requests


def headers(seed: int, index: int) -> tuple[tuple[str, str], ...]:
    rng = random.Random(f"{seed}:{index}:headers")
    request_id = ("x-request-id", f"fuzz-{seed}-{index}")
    return (request_id, rng.choice(HEADERS)) if rng.random() < 0.1 else (request_id,)


def shown(rpc: Rpc, requests: list[bytes], limit: int = 300) -> str:
    """A short repr of what was sent: text format, or the bytes where they do not parse."""
    parts = []
    for data in requests:
        try:
            message = GetMessageClass(rpc.method.input_type).FromString(data)
            text = text_format.MessageToString(message, as_one_line=True, as_utf8=True)
        except DecodeError:
            text = f"<{len(data)} unparsable bytes: {data[:40]!r}>"
        parts.append(text if len(text) <= limit else text[:limit] + f"… ({len(text)} chars)")
    return " | ".join(parts)


class Watch:
    """Health checks and the processes behind the ports, from a thread of its own: the
    fuzzer's event loop is busy, and its delays must not read as the mesh's failures."""

    def __init__(self, targets: dict[str, str]) -> None:
        self.targets = targets
        self.checks = 0
        self.failures: list[str] = []
        self.crashes: list[str] = []
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._listeners = listeners(targets)
        self._thread = threading.Thread(target=self._run, name="fuzz-watch", daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._look_at_processes()

    def _run(self) -> None:
        channels = {name: grpc.insecure_channel(target) for name, target in self.targets.items()}
        try:
            for round_ in itertools.count(1):
                began = time.monotonic()
                self._check(channels)
                if round_ % LISTENER_CHECK_EVERY == 0:
                    self._look_at_processes()
                if self._stop.wait(max(0.0, HEALTH_INTERVAL_S - (time.monotonic() - began))):
                    return
        finally:
            for channel in channels.values():
                channel.close()

    def _check(self, channels: dict[str, grpc.Channel]) -> None:
        asked = [
            (name, service, health_pb2_grpc.HealthStub(channel).Check.future(
                health_pb2.HealthCheckRequest(service=service), timeout=HEALTH_TIMEOUT_S
            ))
            for name, channel in channels.items()
            for service in ("", name)
        ]  # fmt: skip
        at = time.monotonic() - self.started
        for name, service, answer in asked:
            self.checks += 1
            try:
                status = answer.result().status
                failed = "" if status == SERVING else ServingStatus.Name(status)
            except grpc.RpcError as error:
                failed = error.code().name
            if failed:
                what = "readiness" if service else "liveness"
                self.failures.append(f"{at:.1f} s: {name} {what} {failed}")

    def _look_at_processes(self) -> None:
        now = listeners(self.targets)
        for name, pid in self._listeners.items():
            if now.get(name) != pid:
                at = time.monotonic() - self.started
                self.crashes.append(f"{at:.1f} s: {name} pid {pid} -> {now.get(name)}")
        self._listeners = now


def listeners(targets: dict[str, str]) -> dict[str, int | None]:
    """The pid listening on each target's port (None: nobody)."""
    ports = {int(target.rpartition(":")[2]): name for name, target in targets.items()}
    found: dict[str, int | None] = dict.fromkeys(targets)
    for connection in psutil.net_connections("tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port in ports:
            found[ports[connection.laddr.port]] = connection.pid
    return found


def logged_errors(log_dir: Path | None, limit: int = 300) -> list[tuple[str, str]]:
    """(request id, "service: message | last traceback line") for every ERROR or
    CRITICAL line in the services' JSON logs (`aimesh up --log-dir`)."""
    if log_dir is None:
        return []
    found = []
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if '"level": "ERROR"' not in line and '"level": "CRITICAL"' not in line:
                continue
            record = json.loads(line)
            message = str(record.get("message", "")).splitlines()[0]
            trace = (record.get("exc_info") or "").strip().splitlines()[-1:]
            text = ADDRESS.sub("0x…", f"{path.stem}: {' | '.join([message, *trace])}")
            found.append((record.get("request_id", ""), text[:limit]))
    return found


async def fuzz(
    targets: dict[str, str],
    *,
    calls: int,
    seconds: float,
    seed: int = 0,
    concurrency: int = 4,
    deadline_s: float = 5.0,
    words: tuple[str, ...] = WORDS,
    log_dir: Path | None = None,
) -> Report:
    """Fuzzes the services at `targets` (name -> host:port) for `calls` calls or `seconds`,
    whichever ends first, and reports what came back and what broke meanwhile."""
    rpcs = await discover_rpcs(targets)
    channels = Channels(targets)
    codes: dict[Rpc, Counter[str]] = {rpc: Counter() for rpc in rpcs}
    examples: dict[tuple[Rpc, str], str] = {}
    findings: list[Finding] = []
    indices = itertools.count()
    started = time.monotonic()

    def rpc_of(index: int) -> Rpc:
        cycle, at = divmod(index, len(rpcs))
        return random.Random(f"{seed}:cycle:{cycle}").sample(rpcs, len(rpcs))[at]

    async def worker() -> None:
        for index in indices:
            if index >= calls or time.monotonic() - started >= seconds:
                return
            rpc = rpc_of(index)
            requests = generate(rpc, seed, index, words)
            metadata = headers(seed, index)
            code, details, reason = await call(channels, rpc, requests, deadline_s, metadata)
            key = f"{code} (asked)" if reason == ASKED_FOR else code
            codes[rpc][key] += 1
            examples.setdefault((rpc, key), f"call {index}: {details[:200]!r}")
            if code in BAD_CODES and reason != ASKED_FOR:
                request_id = metadata[0][1]
                findings.append(Finding(
                    index, rpc.service, rpc.path, code, details, reason, request_id,
                    requests, shown(rpc, requests),
                ))  # fmt: skip

    try:
        with Watch(targets) as watch:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await channels.close()
    elapsed = time.monotonic() - started
    errors = logged_errors(log_dir)
    for finding in findings:
        finding.logs = [text for request_id, text in errors if request_id == finding.request_id]
    return Report(
        seed, concurrency, deadline_s, codes, examples, findings, watch.checks,
        watch.failures, watch.crashes, Counter(text for _, text in errors), elapsed,
    )  # fmt: skip


async def replay(targets: dict[str, str], path: Path, deadline_s: float) -> int:
    """Sends each finding in `path` again; the number that still answer INTERNAL/UNKNOWN."""
    rpcs = {rpc.path: rpc for rpc in await discover_rpcs(targets)}
    channels = Channels(targets)
    still = 0
    for line in (await asyncio.to_thread(path.read_text)).splitlines():
        finding = json.loads(line)
        rpc = rpcs[finding["path"]]
        requests = [base64.b64decode(r) for r in finding["requests"]]
        metadata = (("x-request-id", f"replay-{finding['request_id']}"),)
        code, details, reason = await call(channels, rpc, requests, deadline_s, metadata)
        still += code in BAD_CODES and reason != ASKED_FOR
        print(f"{finding['path']} call {finding['index']}: was {finding['code']}, now {code}"
              f" {details!r}")  # fmt: skip
    await channels.close()
    return still


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.asynccontextmanager
async def started_mesh(
    log_dir: Path, ready_timeout_s: float = 300, http_port: int = 0
) -> AsyncIterator[dict]:
    """`aimesh up` with every service on a free port and a knowledge store of its own
    (the gateway's HTTP API on `http_port`; 0: any free one); stopped (SIGTERM, its
    process group killed after the grace period) on the way out."""
    names = list(discover())
    ports = {name: free_port() for name in names}
    store = Path(tempfile.mkdtemp(prefix="aimesh-fuzz-store-"))
    env = {
        **os.environ,
        "GRPC_VERBOSITY": "ERROR",
        "AIMESH_SERVICES__RETRIEVAL__PATH": str(store),
        "AIMESH_SERVICES__DIFFUSION__MODELS": "digits",
        # Its HTTP API would take the fixed 8000 otherwise.
        "AIMESH_SERVICES__GATEWAY__HTTP_PORT": str(http_port),
        **{f"AIMESH_SERVICES__{name.upper()}__PORT": str(port) for name, port in ports.items()},
        **{f"AIMESH_SERVICES__{name.upper()}__METRICS_PORT": "0" for name in names},
    }
    await asyncio.to_thread(log_dir.mkdir, parents=True, exist_ok=True)
    with (log_dir / "up.out").open("wb") as out:  # its restart messages, if any
        process = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "aimesh"), "up", "--log-dir", str(log_dir),
            env=env, stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip
    targets = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    ready = asyncio.gather(
        *(wait_until_serving(target, name, ready_timeout_s) for name, target in targets.items())
    )
    exited = asyncio.ensure_future(process.wait())
    try:
        await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done() or not all(ready.result()):
            raise SystemExit(f"the mesh did not become ready; logs in {log_dir}")
        yield targets
    finally:
        ready.cancel()
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(exited), 90)
        with contextlib.suppress(ProcessLookupError):  # whatever outlived the grace period
            os.killpg(process.pid, signal.SIGKILL)
        await exited
        shutil.rmtree(store, ignore_errors=True)


def parse_targets(pairs: list[str]) -> dict[str, str]:
    targets = {}
    for pair in pairs:
        name, _, target = pair.partition("=")
        if not target:
            raise SystemExit(f"--target wants NAME=HOST:PORT, got {pair!r}")
        targets[name] = target
    return targets


async def run(args: argparse.Namespace, run_dir: Path) -> Report | int:
    async with contextlib.AsyncExitStack() as stack:
        targets = parse_targets(args.target)
        log_dir = None
        if not targets:
            log_dir = run_dir / "logs"
            print(f"starting the mesh (logs in {log_dir}) ...", flush=True)
            targets = await stack.enter_async_context(started_mesh(log_dir))
        if args.replay:
            return await replay(targets, args.replay, args.deadline)
        return await fuzz(
            targets, calls=args.calls, seconds=args.seconds, seed=args.seed,
            concurrency=args.concurrency, deadline_s=args.deadline, log_dir=log_dir,
        )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--deadline", type=float, default=5.0, help="seconds per call")
    parser.add_argument(
        "--target", action="append", default=[], metavar="NAME=HOST:PORT",
        help="fuzz this running service instead of starting a mesh (repeat for each)",
    )  # fmt: skip
    parser.add_argument("--replay", type=Path, help="send a findings.jsonl's requests again")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    run_dir = Path("var/fuzz") / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args, run_dir))
    if isinstance(result, int):
        raise SystemExit(1 if result else 0)
    command = f"python -m loadtest.fuzz --calls {args.calls} --seconds {args.seconds:g}"
    markdown = result.markdown(command + (f" --out {args.out}" if args.out else ""))
    print(markdown)
    for problem in [*result.health_failures, *result.crashes]:
        print(problem)
    for (rpc, code), example in result.examples.items():
        if code not in ("OK", "INVALID_ARGUMENT") and not code.endswith("(asked)"):
            print(f"{code} from {rpc.path}, e.g. {example}")
    for text, count in result.logged_errors.most_common():
        print(f"logged {count}x: {text}")
    for finding in result.findings:
        print(finding.describe())
    if result.findings:
        findings = run_dir / "findings.jsonl"
        findings.write_text("".join(finding.as_json() + "\n" for finding in result.findings))
        print(f"{len(result.findings)} INTERNAL/UNKNOWN; requests in {findings}")
    if args.out:
        write(markdown, args.out)
    raise SystemExit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
