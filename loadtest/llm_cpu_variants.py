"""llama.cpp's CPU kernels in the LLM mesh: the AVX2-only build against the dispatched one.

The same LLM mesh (tokenizer, prefill, decode and the router as `aimesh serve` processes,
llama.cpp in both phases, the embedded SmolLM2 GGUF) runs once per build, the builds
alternating round by round (A B A B) so drift on a noisy machine hits both alike:

- dispatched: the project's environment, whose llama-cpp-python carries every x86-64 CPU
  variant of ggml's CPU backend; services/llm/llama_backend.py loads the best one.
- AVX2: llama-cpp-python's wheel built for AVX2 alone (the CPU backend linked in), unpacked
  and put first on every process's PYTHONPATH, so its `llama_cpp` shadows the project's
  (llama_backend loads no variant beside a linked-in CPU backend).

Each run checks in GetInfo of prefill and decode which kernels serve (limits
["cpu_variant"]: "built-in" for the AVX2 build, the variant's name for the dispatched
one) and stops if they are not the build's. Measured per run: the TTFT of a 256-token
prompt with max_new_tokens=1 (prefill through the mesh, each request under a salt of its
own so no prefix cache answers it), single-stream decode tokens/s (64 new tokens, EOS
ignored, greedy) and aggregate tokens/s of 8 clients in a closed loop; the greedy tokens
of both builds are compared.

    python -m loadtest.llm_cpu_variants --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import grpc

from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from loadtest.edge import free_port
from loadtest.llm import PROMPTS
from loadtest.mesh_overhead import write
from mesh.config import MeshSettings
from mesh.health import wait_until_serving
from mesh.info import get_info
from services.llm import llama_backend
from services.llm.artifacts import resolve_model

BEGIN, END = "<!-- llm-cpu-variants:begin -->", "<!-- llm-cpu-variants:end -->"
AVX2_WHEEL = Path("/tmp/avx2-wheel/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl")
BUILT_IN = "built-in"
PROMPT_TOKENS = 256
NEW_TOKENS = 64
CLIENTS = 8
SERVICES = ("tokenizer", "prefill", "decode", "generation")
# The CPU features that decide which ggml variant a machine gets, as /proc/cpuinfo names them.
FEATURES = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


@dataclass(frozen=True)
class Build:
    """How a mesh of one build is started, and the kernels its GetInfo must report."""

    name: str
    pythonpath: str
    expected_variant: str


@dataclass(frozen=True)
class Reply:
    """One Generate: time to the first token, to the last, and what came back."""

    ttft: float
    e2e: float
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Measured:
    build: str
    variant: str
    prefill_s: float
    decode_tps: float
    aggregate_tps: float
    greedy: list[list[int]]


# ---- the builds ----


def avx2_build(root: Path, wheel: Path) -> Build:
    """The wheel's `llama_cpp` unpacked under `root`, to shadow the project's."""
    unpacked = root / "avx2-wheel"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked, [n for n in archive.namelist() if n.startswith("llama_cpp/")])
    return Build("AVX2 build", str(unpacked), BUILT_IN)


def dispatched_build() -> Build:
    """The project's environment, expected to load the variant this process loads."""
    return Build("dispatched build", "", llama_backend.cpu_variant())


# ---- the mesh ----


def start_mesh(root: Path, build: Build, ports: dict[str, int]) -> list[subprocess.Popen]:
    config = root / "aimesh.toml"
    config.write_text(
        '[engines.llm]\nengine = "llama.cpp"\nprefill_engine = "llama.cpp"\n'
        "max_seq_len = 1024\nmax_batch_size = 16\n"
        + "".join(
            f"[services.{name}]\nport = {port}\nmetrics_port = 0\nmax_concurrency = 64\n"
            for name, port in ports.items()
        )
        + f'prefill = ["127.0.0.1:{ports["prefill"]}"]\n'
        f'decode = ["127.0.0.1:{ports["decode"]}"]\n'
        "[services.generation.dependencies]\n"
        f'tokenizer = "127.0.0.1:{ports["tokenizer"]}"\n'
    )
    pythonpath = os.pathsep.join(
        p for p in (build.pythonpath, os.environ.get("PYTHONPATH", "")) if p
    )
    env = {
        **os.environ,
        "AIMESH_CONFIG": str(config),
        "PYTHONPATH": pythonpath,
        "GRPC_VERBOSITY": "ERROR",
        "AIMESH_LOG_LEVEL": "WARNING",
        "OTEL_TRACES_EXPORTER": "none",
    }
    aimesh = Path(sys.executable).parent / "aimesh"
    return [
        subprocess.Popen(
            [str(aimesh), "serve", name],
            env=env,
            stderr=(root / f"{name}.log").open("w"),
        )
        for name in ports
    ]


async def check_kernels(build: Build, ports: dict[str, int]) -> str:
    """The kernels prefill and decode serve with; stops the benchmark if either is not
    `build`'s, since the run would measure the other build."""
    for name, port in ports.items():
        if not await wait_until_serving(f"127.0.0.1:{port}", name, timeout_s=300):
            raise SystemExit(f"{build.name}: {name} did not start")
    for name in ("prefill", "decode"):
        info = await get_info(f"127.0.0.1:{ports[name]}", timeout_s=10)
        if info is None or not info.models:
            raise SystemExit(f"{build.name}: {name} describes no model")
        model = info.models[0]
        variant = model.limits.get("cpu_variant", "")
        if model.engine != "llama.cpp" or variant != build.expected_variant:
            raise SystemExit(
                f"{build.name}: {name} serves on {model.engine} with cpu_variant "
                f"{variant!r}, expected llama.cpp with {build.expected_variant!r}"
            )
    return build.expected_variant


async def generate(stub, prompt: str, new_tokens: int, salt: str) -> Reply:
    started = time.perf_counter()
    first = last = None
    token_ids: list[int] = []
    usage = None
    async for message in stub.Generate(
        generation_pb2.GenerateRequest(
            prompt=prompt,
            stopping=sampling_pb2.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True),
            cache_salt=salt,
        ),
        timeout=300,
    ):
        if message.HasField("chunk") and message.chunk.token_ids:
            last = time.perf_counter()
            first = first or last
            token_ids.extend(message.chunk.token_ids)
        elif message.HasField("complete"):
            usage = message.complete.usage
    if first is None or last is None or usage is None or len(token_ids) != new_tokens:
        raise SystemExit(f"{len(token_ids)} tokens of {new_tokens} for {prompt[:40]!r}")
    return Reply(
        first - started, last - started, token_ids, usage.prompt_tokens, usage.cached_tokens
    )


async def prefill_seconds(stub, prompt: str, repeats: int, tag: str) -> float:
    """Median TTFT of `prompt` with one new token, each request under a salt of its own so
    no prefix cached by an earlier one shortens it."""
    times = []
    for index in range(repeats):
        reply = await generate(stub, prompt, 1, f"{tag}-{index}")
        if reply.prompt_tokens != PROMPT_TOKENS or reply.cached_tokens:
            raise SystemExit(
                f"prefill prompt: {reply.prompt_tokens} tokens, {reply.cached_tokens} cached; "
                f"expected {PROMPT_TOKENS}, none cached"
            )
        times.append(reply.ttft)
    return statistics.median(times)


async def closed_loop(stub, requests_each: int, tag: str) -> float:
    """Aggregate new tokens/s of CLIENTS clients, each sending its next request when the
    last one ends."""
    tokens = [0]

    async def client(index: int) -> None:
        for i in range(requests_each):
            prompt = PROMPTS[(index + i) % len(PROMPTS)]
            reply = await generate(stub, prompt, NEW_TOKENS, f"{tag}-{index}-{i}")
            tokens[0] += len(reply.token_ids)

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(CLIENTS)))
    return tokens[0] / (time.perf_counter() - started)


async def measure(build: Build, ports: dict[str, int], long_prompt: str, tag: str) -> Measured:
    variant = await check_kernels(build, ports)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['generation']}") as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        await generate(stub, long_prompt, 1, f"{tag}-warm-prefill")  # warm every hop
        await generate(stub, PROMPTS[0], NEW_TOKENS, f"{tag}-warm-decode")
        prefill_s = await prefill_seconds(stub, long_prompt, 5, tag)
        decode_rates, greedy = [], []
        for index, prompt in enumerate(PROMPTS[:4]):
            reply = await generate(stub, prompt, NEW_TOKENS, f"{tag}-single-{index}")
            decode_rates.append((NEW_TOKENS - 1) / (reply.e2e - reply.ttft))
            greedy.append(reply.token_ids)
        aggregate = await closed_loop(stub, 2, tag)
    return Measured(
        build.name, variant, prefill_s, statistics.median(decode_rates), aggregate, greedy
    )


def run_mesh(build: Build, long_prompt: str, tag: str) -> Measured:
    ports = {name: free_port() for name in SERVICES}
    with tempfile.TemporaryDirectory() as root:
        processes = start_mesh(Path(root), build, ports)
        try:
            return asyncio.run(measure(build, ports, long_prompt, tag))
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=30)


def long_prompt_of(model_dir: Path) -> str:
    """Text of exactly PROMPT_TOKENS tokens (the mesh's usage confirms the count)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = " ".join(PROMPTS * 8)
    ids = tokenizer(text)["input_ids"][:PROMPT_TOKENS]
    return tokenizer.decode(ids)


# ---- report ----


def cpu_summary() -> tuple[str, list[str]]:
    """The CPU's model name and which of FEATURES it has."""
    model, flags = platform.processor(), set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    return model, [feature for feature in FEATURES if feature in flags]


# The engine alone, in a process of the build: the kernels' own speed, without the mesh's
# other processes competing for the two cores.
ENGINE_PROBE = """
import json, os, statistics, time
from services.llm import llama_backend
from services.llm.artifacts import gguf_path
from services.llm.described import config_of
from services.llm.gguf import read_facts
from services.llm.llama_cpp import LlamaCpp
model = LlamaCpp(gguf_path(), config_of(read_facts(gguf_path())), sequences=1,
                 max_seq_len=512, threads=len(os.sched_getaffinity(0)))
prompt, prefill, decode = list(range(100, 100 + PROMPT)), [], []
for _ in range(5):
    started = time.perf_counter()
    logits, state = model.prefill(prompt)
    prefill.append(time.perf_counter() - started)
    model.load(0, state)
    token, started = int(logits.argmax()), time.perf_counter()
    for step in range(NEW):
        token = int(model.decode([token], [PROMPT + step], [0])[0].argmax())
    decode.append(NEW / (time.perf_counter() - started))
    model.free(0)
print(json.dumps([llama_backend.cpu_variant(), statistics.median(prefill),
                  statistics.median(decode)]))
"""


def engine_alone(build: Build) -> tuple[str, float, float]:
    """(kernels, prefill s, decode tokens/s) of LlamaCpp alone in a process of `build`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (build.pythonpath, os.environ.get("PYTHONPATH", "")) if p
    )}  # fmt: skip
    code = ENGINE_PROBE.replace("PROMPT", str(PROMPT_TOKENS)).replace("NEW", str(NEW_TOKENS))
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    variant, prefill_s, decode_tps = json.loads(result.stdout.strip().splitlines()[-1])
    if variant != build.expected_variant:
        raise SystemExit(f"{build.name}: the engine ran on {variant}, not {build.expected_variant}")
    return variant, prefill_s, decode_tps


def report(
    runs: list[Measured],
    engines: list[tuple[str, tuple[str, float, float]]],
    rounds: int,
    wheel: Path,
    load: float,
) -> str:
    avx2 = [r for r in runs if r.build == "AVX2 build"]
    dispatched = [r for r in runs if r.build == "dispatched build"]
    variant = dispatched[0].variant
    model, present = cpu_summary()
    absent = [feature for feature in FEATURES if feature not in present]

    def medians(group: list[Measured]) -> tuple[float, float, float]:
        return (
            statistics.median(r.prefill_s for r in group) * 1e3,
            statistics.median(r.decode_tps for r in group),
            statistics.median(r.aggregate_tps for r in group),
        )

    a, d = medians(avx2), medians(dispatched)
    ratios = " | ".join(f"{x / y:.2f}" for x, y in zip(d, a, strict=True))
    per_round = [
        f"| {index // 2 + 1} | {r.build} | {r.variant} | {r.prefill_s * 1e3:.0f} | "
        f"{r.decode_tps:.1f} | {r.aggregate_tps:.1f} |"
        for index, r in enumerate(runs)
    ]
    reference = runs[0].greedy
    differing = [
        f"{r.build} (round {index // 2 + 1})"
        for index, r in enumerate(runs)
        if r.greedy != reference
    ]
    if differing:
        greedy = f"Greedy tokens differ: {', '.join(differing)} against round 1's {runs[0].build}."
    else:
        greedy = (
            f"Greedy tokens: identical in every run of both builds ({len(reference)} prompts, "
            f"{NEW_TOKENS} tokens each)."
        )
    wide = [f for f in present if f.startswith(("avx512", "amx", "avx_vnni"))]
    if wide:
        reading = (
            f"This CPU has {', '.join(wide)}: the dispatcher loads the {variant} variant, "
            "whose kernels use units the AVX2 build leaves idle."
        )
    else:
        reading = (
            f"This CPU has AVX2 but no AVX-512, AVX-VNNI or AMX, so the dispatcher loads the "
            f"{variant} variant: the same instruction set the AVX2 build was compiled for. "
            "Equal figures (within this machine's noise) are the expected result here; the "
            "gain appears on AVX-512/AMX machines, where the AVX2 build leaves those units "
            "idle and the dispatcher loads a variant that uses them."
        )
    lines = [
        BEGIN,
        "## LLM mesh: llama.cpp's AVX2-only build vs the dispatched CPU variants",
        "",
        f"Command: `python -m loadtest.llm_cpu_variants --rounds {rounds}` "
        "(`make bench-cpu-variants`). The LLM mesh (tokenizer, prefill, decode, router as "
        "`aimesh serve` processes; llama.cpp in prefill and decode, SmolLM2-135M-Instruct "
        f"Q4_1 GGUF) once per build per round, the builds' order swapped each round (A B, B A, "
        "...) so drift over the run favours neither. AVX2 build: `{wheel.name}` "
        "compiled for AVX2 alone (CPU backend linked in), unpacked and first on every "
        "process's PYTHONPATH (llama_backend loads no variant beside a linked-in CPU "
        "backend). Dispatched build: the project's llama-cpp-python "
        f"{version('llama_cpp_python')} with every x86-64 variant, the best loaded at run "
        "time. GetInfo of prefill and decode confirmed the kernels of every run "
        "(`cpu_variant`). Prefill: median TTFT of 5 requests of a "
        f"{PROMPT_TOKENS}-token prompt with max_new_tokens=1, none from a prefix cache. "
        f"Decode: median of 4 single-stream requests, {NEW_TOKENS} new tokens (EOS ignored, "
        f"greedy), tokens after the first over their time. {CLIENTS} clients: closed loop, "
        f"2 requests each of {NEW_TOKENS} tokens, all new tokens over the wall time.",
        "",
        f"Machine: {model}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"load average {load:.1f} at the start (the machine is shared: read the rounds' "
        "spread before the ratios). "
        f"CPU flags: {', '.join(present) or 'none of those below'}; absent: "
        f"{', '.join(absent) or 'none'}. Variant loaded by the dispatcher: {variant}. "
        f"The dispatched build's llama.cpp features line: `{llama_backend.cpu_features()}`.",
        "",
        "| build | kernels | prefill 256 tokens, ms | decode, 1 stream, tok/s | "
        f"{CLIENTS} clients, tok/s |",
        "|---|---|---|---|---|",
        f"| AVX2 build (median of {len(avx2)}) | {BUILT_IN} | {a[0]:.0f} | {a[1]:.1f} | "
        f"{a[2]:.1f} |",
        f"| dispatched build (median of {len(dispatched)}) | {variant} | {d[0]:.0f} | "
        f"{d[1]:.1f} | {d[2]:.1f} |",
        f"| dispatched / AVX2 | | {ratios} |",
        "",
        "(Prefill is a time: a ratio below 1 is the dispatched build faster; tokens/s: above 1.)",
        "",
        f"| round | build | kernels | prefill ms | decode tok/s | {CLIENTS} clients tok/s |",
        "|---|---|---|---|---|---|",
        *per_round,
        "",
        greedy,
        "",
        "The engine alone (`LlamaCpp` in one process of each build, no mesh: the same "
        f"{PROMPT_TOKENS}-token prefill and {NEW_TOKENS} greedy decode steps, median of 5; "
        "the builds alternating as above), which is what the kernels do without the other "
        "processes competing for the cores:",
        "",
        "| build | kernels | prefill ms | decode tok/s |",
        "|---|---|---|---|",
        *(
            f"| {name} | {variant} | {prefill_s * 1e3:.0f} | {decode_tps:.1f} |"
            for name, (variant, prefill_s, decode_tps) in engines
        ),
        "",
        reading,
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--avx2-wheel", type=Path, default=AVX2_WHEEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds: at least 2, the machine's noise needs them")
    load = os.getloadavg()[0]
    long_prompt = long_prompt_of(resolve_model(None, MeshSettings().cache_dir))
    runs, engines = [], []
    with tempfile.TemporaryDirectory() as root:
        builds = [avx2_build(Path(root), args.avx2_wheel), dispatched_build()]
        for round_index in range(args.rounds):
            for build in builds if round_index % 2 == 0 else builds[::-1]:
                engines.append((build.name, engine_alone(build)))
                run = run_mesh(build, long_prompt, f"r{round_index}-{build.name}")
                runs.append(run)
                print(
                    f"round {round_index + 1}, {run.build} ({run.variant}): prefill "
                    f"{run.prefill_s * 1e3:.0f} ms, decode {run.decode_tps:.1f} tok/s, "
                    f"{CLIENTS} clients {run.aggregate_tps:.1f} tok/s",
                    file=sys.stderr,
                )
    markdown = report(runs, engines, args.rounds, args.avx2_wheel, load)
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
