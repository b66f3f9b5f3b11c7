"""Fuzzing the gateway's HTTP surface: generated requests on every route of the
OpenAI-compatible API, as loadtest/fuzz.py fuzzes the mesh's RPCs.

Requests come from loadtest.fuzz_http's hypothesis strategies, drawn up front from the
seed (the same seed, the same requests): mutated valid bodies, any JSON, garbage, cut and
deeply nested bodies, bodies past the gateway's cap (plain and chunked), varied headers,
other methods and unknown paths, on /v1/chat/completions, /v1/completions,
/v1/responses, /v1/embeddings, /v1/rerank, /v1/images/generations, /v1/models, /v1/usage
and /health.
They go `--concurrency` at a time; each answer is judged:

- a 5xx other than the 503 and 504 the mesh may answer for a request it cannot serve
  now: a finding (goal 0);
- an error answer that is not OpenAI's `{"error": {"message", "type", "param", "code"}}`:
  a finding;
- a body past the cap answered otherwise than 413 (or the 401/403 that come before the
  body is read): a finding;
- no answer (a timeout, a dropped connection): a finding.

Without --url it starts the whole mesh with `aimesh up` (loadtest.fuzz.started_mesh,
the gateway's HTTP API on a free port), watches every service's health and process as
fuzz.py does (a failed check or a crash: goal 0), and reads the models each surface
serves from the services themselves (services.gateway.catalog). After the run the
gateway's /health must answer 200. Findings are printed with the request and written to
var/fuzz-gateway/<time>/findings.jsonl.

    python -m loadtest.fuzz_gateway --requests 2000 --seconds 300 --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtest.fuzz import Watch, free_port, logged_errors, started_mesh
from loadtest.fuzz_http import HttpCase, Models, draw_cases, http_cases
from loadtest.mesh_overhead import write
from services.gateway.catalog import SURFACES, Catalog
from services.gateway.settings import GatewayOptions

BEGIN, END = "<!-- fuzz-gateway:begin -->", "<!-- fuzz-gateway:end -->"
# What the mesh answers for a well-formed request it cannot serve now (a dependency
# down or overloaded, a deadline): not the gateway's fault.
MESH_STATUSES = frozenset({503, 504})
# A body past the cap is refused before it is read; a key is checked before that.
OVERSIZE_STATUSES = frozenset({401, 403, 413})
NO_ANSWER = "no answer"
HEALTH_WAIT_S = 30.0
CHUNK_BYTES = 16 * 1024
DEFAULT_MAX_BODY_BYTES = GatewayOptions.model_fields["max_body_bytes"].default


@dataclass
class Finding:
    index: int
    case: HttpCase
    status: int | None
    problem: str
    request_id: str
    answer: str

    def as_json(self) -> str:
        case = self.case
        data = {
            "index": self.index, "status": self.status, "problem": self.problem,
            "request_id": self.request_id, "answer": self.answer, "kind": case.kind,
            "method": case.method, "path": case.path, "chunked": case.chunked,
            "oversize": case.oversize,
            "headers": [[name, base64.b64encode(value).decode()] for name, value in case.headers],
            "body": None if case.body is None else base64.b64encode(case.body).decode(),
        }  # fmt: skip
        return json.dumps(data)

    def describe(self) -> str:
        case = self.case
        body = "none" if case.body is None else f"{len(case.body)} bytes {case.body[:300]!r}"
        return (
            f"{self.problem}: {case.method} {case.path} ({case.kind}, request {self.index},"
            f" x-request-id {self.request_id})\n  headers: {case.headers!r}\n  body: {body}"
            f"{' chunked' if case.chunked else ''}{' padded past the cap' if case.oversize else ''}"
            f"\n  answer: {self.answer[:300]!r}"
        )


@dataclass
class Report:
    seed: int
    concurrency: int
    timeout_s: float
    statuses: dict[str, Counter[str]]  # route -> status -> answers
    kinds: Counter[str]
    findings: list[Finding]
    health_after: str  # "" when /health answered 200
    seconds: float
    health_checks: int = 0
    health_failures: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    logged_errors: Counter[str] = field(default_factory=Counter)

    @property
    def made(self) -> int:
        return sum(sum(counts.values()) for counts in self.statuses.values())

    @property
    def ok(self) -> bool:
        return not (self.findings or self.health_after or self.health_failures or self.crashes)

    def bad(self, route: str) -> int:
        return sum(1 for finding in self.findings if finding.case.route == route)

    def markdown(self, command: str) -> str:
        kinds = ", ".join(f"{kind} {count}" for kind, count in self.kinds.most_common())
        lines = [
            BEGIN,
            "## Fuzzing the gateway's HTTP API",
            "",
            f"Command: `{command}` (`make fuzz`), seed {self.seed}. Every route of the"
            " OpenAI-compatible gateway of one `aimesh up` (127.0.0.1), requests drawn"
            " from hypothesis strategies (loadtest/fuzz_http.py): valid bodies with hostile"
            " fields (lone surrogates, integers past int32/uint64, NaN, 5000-digit numbers,"
            " wrong types, deep nesting), any JSON, garbage, cut bodies, bodies past the"
            " gateway's cap (plain and chunked), other content types, keys, methods and"
            f" paths. Bodies: {kinds}. {self.made} requests in {self.seconds:.0f} s,"
            f" {self.concurrency} at a time, {self.timeout_s:g} s timeout each. A finding"
            " is a 5xx other than the mesh's 503/504, an error not in OpenAI's shape, a body"
            " past the cap not refused with 413, or no answer: the goal-0 column.",
            "",
            "| route | requests | statuses | findings |",
            "|---|---|---|---|",
        ]
        for route, counts in sorted(self.statuses.items()):
            seen = ", ".join(f"{status} {count}" for status, count in counts.most_common())
            lines.append(f"| `{route}` | {sum(counts.values())} | {seen} | {self.bad(route)} |")
        lines += [
            f"| **all** | {self.made} | | {len(self.findings)} |",
            "",
            f"Crashes: {len(self.crashes)}. Health checks failed: {len(self.health_failures)}"
            f" of {self.health_checks}. /health after the run:"
            f" {self.health_after or '200'}. ERROR lines in the services' logs:"
            f" {sum(self.logged_errors.values())}.",
            END,
        ]
        return "\n".join(lines)


def openai_error(answer: httpx.Response) -> bool:
    """Whether the body is `{"error": {"message": str, "type": str, "param", "code"}}`."""
    try:
        body = answer.json()
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
        and {"param", "code"} <= error.keys()
    )


def judged(case: HttpCase, answer: httpx.Response) -> str | None:
    """What is wrong with `answer` to `case`; None when nothing is."""
    status = answer.status_code
    if status >= 500 and status not in MESH_STATUSES:
        return f"{status} answer"
    if status >= 400 and case.method != "HEAD" and not openai_error(answer):
        return f"{status} not in OpenAI's error shape"
    if case.oversize and status not in OVERSIZE_STATUSES:
        return f"{status} for a body past the cap"
    return None


async def _pieces(payload: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(payload), CHUNK_BYTES):
        yield payload[start : start + CHUNK_BYTES]


async def send(
    client: httpx.AsyncClient, case: HttpCase, request_id: str, max_body_bytes: int
) -> httpx.Response:
    sent = list(case.headers)
    if all(name != "x-request-id" for name, _ in sent):
        sent.append(("x-request-id", request_id.encode()))
    payload = case.payload(max_body_bytes)
    content = _pieces(payload) if payload is not None and case.chunked else payload
    return await client.request(case.method, case.path, headers=sent, content=content)


async def healthy(url: str, wait_s: float = HEALTH_WAIT_S) -> str:
    """ "" once the gateway's /health answers 200 (within `wait_s`); else what it said."""
    said = ""
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        until = time.monotonic() + wait_s
        while time.monotonic() < until:
            try:
                answer = await client.get("/health")
            except httpx.TransportError as error:
                said = f"no answer ({type(error).__name__})"
            else:
                if answer.status_code == 200:
                    return ""
                said = f"{answer.status_code} {answer.text[:200]}"
            await asyncio.sleep(0.5)
    return said or "no answer"


async def fuzz(
    url: str,
    models: Models,
    *,
    requests: int,
    seconds: float,
    seed: int = 0,
    concurrency: int = 4,
    timeout_s: float = 60.0,
    key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    watch: dict[str, str] | None = None,
    log_dir: Path | None = None,
) -> Report:
    """Sends `requests` generated requests to the gateway at `url` (or as many as
    `seconds` allow), `concurrency` at a time, and reports what came back; `watch`
    (name -> gRPC target) adds fuzz.py's health and process watch of those services."""
    cases = await asyncio.to_thread(draw_cases, http_cases(models, key), requests, seed)
    statuses: dict[str, Counter[str]] = {}
    kinds: Counter[str] = Counter()
    findings: list[Finding] = []
    indices = itertools.count()
    limits = httpx.Limits(max_connections=concurrency)
    started = time.monotonic()

    async def worker(client: httpx.AsyncClient) -> None:
        for index in indices:
            if index >= len(cases) or time.monotonic() - started >= seconds:
                return
            case = cases[index]
            request_id = f"fuzz-gw-{seed}-{index}"
            kinds[case.kind] += 1
            counts = statuses.setdefault(case.route, Counter())
            try:
                answer = await send(client, case, request_id, max_body_bytes)
            except httpx.LocalProtocolError:
                counts["unsendable"] += 1  # the client refused it (a header h11 forbids)
                continue
            except httpx.TransportError as error:
                counts[NO_ANSWER] += 1
                problem = f"{NO_ANSWER} ({type(error).__name__})"
                findings.append(Finding(index, case, None, problem, request_id, str(error)))
                continue
            counts[str(answer.status_code)] += 1
            problem = judged(case, answer)
            if problem is not None:
                given = answer.headers.get("x-request-id", request_id)
                status = answer.status_code
                findings.append(Finding(index, case, status, problem, given, answer.text))

    watcher = Watch(watch) if watch else None
    with watcher or contextlib.nullcontext():
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
            await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.monotonic() - started
        health_after = await healthy(url)
    report = Report(seed, concurrency, timeout_s, statuses, kinds, findings, health_after, elapsed)
    if watcher is not None:
        report.health_checks = watcher.checks
        report.health_failures = watcher.failures
        report.crashes = watcher.crashes
    report.logged_errors = Counter(text for _, text in logged_errors(log_dir))
    return report


async def served_models(targets: dict[str, str]) -> Models:
    """The first model each surface serves, read from the services as the gateway reads
    them ("none" where a surface has no service)."""
    catalog = Catalog({name: targets[name] for name in SURFACES if name in targets})
    await catalog.refresh()

    def first(surface: str) -> str:
        return next(iter(catalog.serving(surface)), "none")

    return Models(first("chat"), first("embedding"), first("image"), first("rerank"))


async def run(args: argparse.Namespace, run_dir: Path) -> Report:
    async with contextlib.AsyncExitStack() as stack:
        url, watch, log_dir, key = args.url, None, None, args.key
        if url is None:
            log_dir = run_dir / "logs"
            port = free_port()
            print(f"starting the mesh (logs in {log_dir}) ...", flush=True)
            watch = await stack.enter_async_context(started_mesh(log_dir, http_port=port))
            url = f"http://127.0.0.1:{port}"
            models = await served_models(watch)
        else:
            models = Models(args.chat_model, args.embedding_model, args.image_model, "none")
        return await fuzz(
            url, models, requests=args.requests, seconds=args.seconds, seed=args.seed,
            concurrency=args.concurrency, timeout_s=args.timeout, key=key,
            max_body_bytes=args.max_body_bytes, watch=watch, log_dir=log_dir,
        )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument(
        "--url", help="fuzz this running gateway (http://HOST:PORT) instead of starting a mesh"
    )
    parser.add_argument("--key", help="the API key to send (with --url)")
    parser.add_argument("--chat-model", default="none", help="with --url")
    parser.add_argument("--embedding-model", default="none", help="with --url")
    parser.add_argument("--image-model", default="none", help="with --url")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    run_dir = Path("var/fuzz-gateway") / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(run(args, run_dir))
    command = (
        f"python -m loadtest.fuzz_gateway --requests {args.requests} --seconds {args.seconds:g}"
    )
    markdown = report.markdown(command + (f" --out {args.out}" if args.out else ""))
    print(markdown)
    for problem in [*report.health_failures, *report.crashes]:
        print(problem)
    if report.health_after:
        print(f"/health after the run: {report.health_after}")
    for text, count in report.logged_errors.most_common():
        print(f"logged {count}x: {text}")
    for finding in report.findings:
        print(finding.describe())
    if report.findings:
        findings = run_dir / "findings.jsonl"
        findings.write_text("".join(finding.as_json() + "\n" for finding in report.findings))
        print(f"{len(report.findings)} findings; requests in {findings}")
    if args.out:
        write(markdown, args.out)
    raise SystemExit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
