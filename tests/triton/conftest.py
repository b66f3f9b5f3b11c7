"""A real Triton Inference Server (2.51, CPU, Python backend) serving aimesh's model
repository (k8s/triton-model-repository), started as its own process.

The server binary ships in PyTriton's wheel, which needs numpy<2 and a protobuf of its own,
so it lives in a virtual environment of its own under var/, created here once per machine
(about a minute) and reused while its requirements stay the same. Triton's Python stub
embeds libpython, hence LD_LIBRARY_PATH; it binds 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import tritonclient.grpc.aio as triton_aio
from tritonclient.utils import InferenceServerException

from mesh.config import MeshSettings
from services.embedder.backends import onnx_graph
from services.embedder.model import default_model
from tests.conftest import ROOT, free_port

VENV = ROOT / "var" / "triton-venv"
REQUIREMENTS = ("nvidia-pytriton==0.7.0", "numpy<2", "onnxruntime<1.24")
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


class TritonServer:
    """tritonserver on a fixed port, stoppable and restartable on that same port."""

    def __init__(self, venv: Path, repository: Path, work: Path) -> None:
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
        self.port = free_port()
        self.log = work / "tritonserver.log"
        libdir = sysconfig.get_config_var("LIBDIR")
        self.env = {
            **os.environ,
            "LD_LIBRARY_PATH": f"{libdir}:{site / 'nvidia_pytriton.libs'}",
            "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(site),
        }
        self.process: subprocess.Popen | None = None

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
                "--exit-timeout-secs=5",
            ],
            env=self.env,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
        )

    async def wait_ready(self, model: str, timeout_s: float = 120) -> None:
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

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory) -> Path:
    """aimesh's repository with the embedder's exported graph in place."""
    repository = tmp_path_factory.mktemp("triton") / "models"
    shutil.copytree(REPOSITORY, repository)
    graph = onnx_graph(default_model(), MeshSettings().cache_dir)
    (repository / "sentence_embedding" / "1" / "model.onnx").symlink_to(graph)
    return repository


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def triton(model_repository, tmp_path_factory) -> AsyncIterator[TritonServer]:
    venv = await asyncio.to_thread(triton_venv)
    server = TritonServer(venv, model_repository, tmp_path_factory.mktemp("triton-run"))
    server.start()
    try:
        await server.wait_ready("sentence_embedding")
        yield server
    finally:
        server.stop()
