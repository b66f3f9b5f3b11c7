"""A real Triton Inference Server (2.51, CPU, Python backend) serving aimesh's model
repository (k8s/triton-model-repository), started as its own process: for the Triton
tests and the Triton benchmark.

The server binary ships in PyTriton's wheel, which needs numpy<2 and a protobuf of its own,
so it lives in a virtual environment of its own under var/, created here once per machine
and reused while its requirements stay the same. The models' own imports (ONNX Runtime,
torch and transformers for the LLM) come from that environment, as they would come from a
Triton image. Triton's Python stub embeds libpython, hence LD_LIBRARY_PATH; it binds
127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import tritonclient.grpc.aio as triton_aio
from tritonclient.utils import InferenceServerException

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "var" / "triton-venv"
REQUIREMENTS = (
    "nvidia-pytriton==0.7.0",
    "numpy<2",
    "onnxruntime<1.24",
    # The LLM model (text_generation) runs transformers on torch; the CPU wheel on this disk.
    "torch==2.13.0",
    "transformers==5.24.0",
)
REPOSITORY = ROOT / "k8s" / "triton-model-repository"


def triton_venv() -> Path:
    """The server's environment, (re)built when its requirements change."""
    marker = VENV / "aimesh-requirements.txt"
    wanted = "\n".join(REQUIREMENTS)
    if marker.exists() and marker.read_text() == wanted:
        return VENV
    shutil.rmtree(VENV, ignore_errors=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(VENV)], check=True)
    subprocess.run(
        [str(VENV / "bin" / "pip"), "install", "--quiet", *REQUIREMENTS], check=True, timeout=900
    )
    marker.write_text(wanted)
    return VENV


ARTIFACTS_SCRIPT = REPOSITORY.parent / "components" / "triton" / "artifacts.py"


def repository_models() -> list[str]:
    return sorted(p.parent.name for p in REPOSITORY.glob("*/config.pbtxt"))


def prepare_repository(out: Path, cache_dir: Path, models: Sequence[str] | None = None) -> Path:
    """A copy of aimesh's repository (all models, or those named) with each model's
    artifact linked in by the script the Triton image build runs, so tests and benchmarks
    serve what a deployment would."""
    models = list(models or repository_models())
    for model in models:
        shutil.copytree(
            REPOSITORY / model, out / model, ignore=shutil.ignore_patterns("__pycache__")
        )
    spec = importlib.util.spec_from_file_location("triton_artifacts", ARTIFACTS_SCRIPT)
    assert spec is not None and spec.loader is not None
    artifacts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(artifacts)
    artifacts.write(out, cache_dir, models, link=True)
    return out


# Triton's admin protocols (load and unload models, read configs and statistics, register
# shared memory, change tracing and logging): none of them is what the mesh calls (health,
# metadata, inference), so they answer only a request with ADMIN_HEADER set to the
# server's own random key. k8s/components/triton/triton.yaml restricts the same ones.
ADMIN_PROTOCOLS = "model-repository,model-config,shared-memory,statistics,trace,logging"
ADMIN_KEY_NAME = "admin-key"
# Triton's gRPC endpoint expects the key under this prefixed name (its HTTP one as it is).
ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_KEY_NAME}"


class TritonServer:
    """tritonserver on a fixed port, stoppable and restartable on that same port, its
    admin protocols behind `admin_key`."""

    def __init__(
        self,
        venv: Path,
        repository: Path,
        work: Path,
        port: int,
        *,
        otlp_traces_url: str | None = None,
        admin_key: str | None = None,
    ) -> None:
        site = next((venv / "lib").glob("python3*/site-packages"))
        bundled = site / "pytriton" / "tritonserver"
        self.backends = work / "backends"
        python_backend = self.backends / "python"
        python_backend.mkdir(parents=True, exist_ok=True)
        for file in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy(bundled / "backends" / "python" / file, python_backend)
        stub = bundled / "python_backend_stubs" / "3.11" / "triton_python_backend_stub"
        shutil.copy(stub, python_backend)
        self.binary = bundled / "bin" / "tritonserver"
        self.repository = repository
        self.port = port
        self.log = work / "tritonserver.log"
        libdir = sysconfig.get_config_var("LIBDIR")
        self.env = {
            **os.environ,
            "LD_LIBRARY_PATH": f"{libdir}:{site / 'nvidia_pytriton.libs'}",
            "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(site),
        }
        # Triton's OpenTelemetry mode: every request traced, exported over OTLP/HTTP,
        # joining the trace its client's traceparent header names.
        self.tracing = (
            [
                "--trace-config=mode=opentelemetry",
                "--trace-config=rate=1",
                "--trace-config=level=TIMESTAMPS",
                f"--trace-config=opentelemetry,url={otlp_traces_url}",
                "--trace-config=opentelemetry,resource=service.name=triton",
            ]
            if otlp_traces_url
            else []
        )
        self.process: subprocess.Popen | None = None
        self.admin_key = admin_key or secrets.token_hex(16)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                str(self.binary),
                f"--model-repository={self.repository}",
                f"--backend-directory={self.backends}",
                "--grpc-address=127.0.0.1",
                f"--grpc-port={self.port}",
                "--allow-http=false",
                "--allow-metrics=false",
                "--log-info=true",
                "--exit-timeout-secs=5",
                f"--grpc-restricted-protocol={ADMIN_PROTOCOLS}:{ADMIN_KEY_NAME}={self.admin_key}",
                *self.tracing,
            ],
            env=self.env,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
        )

    async def wait_ready(self, model: str, timeout_s: float = 180) -> None:
        async with triton_aio.InferenceServerClient(self.url) as client:
            for _ in range(int(timeout_s * 4)):
                assert self.process is not None and self.process.poll() is None, (
                    self.log.read_text()
                )
                try:
                    if await client.is_model_ready(model):
                        return
                except InferenceServerException:
                    pass
                await asyncio.sleep(0.25)
        raise AssertionError(f"Triton did not load {model}:\n{self.log.read_text()[-3000:]}")

    async def wait_all_ready(self) -> None:
        """Every model of aimesh's repository loaded: after a (re)start."""
        for model in repository_models():
            await self.wait_ready(model)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
