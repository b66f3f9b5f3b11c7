"""Where the terrain UNet's forward pass runs: an ONNX Runtime session in this process, or
the same ONNX file on Triton Inference Server.

Everything around a pass (noise, tiles, blending, heights, the cancel check between
tiles) belongs to `TerrainSampling` and is the same for both, so an image depends on its
seed and not on where its passes ran. Both take the graph's own feeds and return its
`denoised` output, so Triton serves the file unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import grpc
import numpy as np
import onnxruntime as ort

from mesh import deadline
from mesh.errors import local_error, status
from mesh.failures import NotReady
from mesh.triton import TritonModel

OUTPUT = "denoised"
# How long past a pass's own ModelInfer timeout the runner thread still waits for the
# event loop to hand back its outcome. Only a stalled or stopped loop ever uses it.
LOOP_SLACK_S = 5.0


class Denoiser(Protocol):
    # Memory a pass adds to this process, for the job queue's estimate.
    workspace_bytes: int
    # For ListModels: what runs the passes.
    runs_on: str
    # For GetInfo: where the passes run ("cpu", "cuda", "triton").
    device: str

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        """One forward pass from a job's runner thread: the graph's feeds -> `denoised`."""
        ...


class OnnxDenoiser:
    # Bytes ONNX Runtime's CPU arena grows by for one 128x128 forward pass (measured, with
    # headroom); a CUDA arena is of the same order.
    workspace_bytes = 256 * 1024 * 1024
    runs_on = "ONNX Runtime"

    def __init__(self, path: Path, device: str, threads: int | None) -> None:
        """A session on CUDA when asked for or (device "auto") when the provider exists."""
        available = ort.get_available_providers()
        if device == "cuda" and "CUDAExecutionProvider" not in available:
            raise NotReady("device cuda was asked for, but ONNX Runtime has no CUDA provider")
        providers = ["CPUExecutionProvider"]
        if device != "cpu" and "CUDAExecutionProvider" in available:
            providers.insert(0, "CUDAExecutionProvider")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
        self.providers = tuple(self.session.get_providers())
        self.device = "cuda" if "CUDAExecutionProvider" in self.providers else "cpu"

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        return self.session.run([OUTPUT], dict(feeds))[0]


class TritonDenoiser:
    """The same graph on Triton, called from a job's runner thread.

    The Triton client belongs to the server's event loop, so each pass is handed to that
    loop and the runner thread waits for its outcome. The job's deadline comes along: the
    servicer runs a job in a copy of its handler's context, and a coroutine handed over
    with run_coroutine_threadsafe runs in a copy of the handing thread's context, so
    ModelInfer's timeout is what is left of the job's budget. Triton's failures arrive as
    the mesh's (UNAVAILABLE while it is down, CIRCUIT_OPEN once the breaker opens) and
    fail the job; a cancelled job stops at the check before its next pass.
    """

    workspace_bytes = 0  # a pass's memory is Triton's
    runs_on = "Triton Inference Server"
    device = "triton"

    def __init__(self, model: TritonModel, loop: asyncio.AbstractEventLoop) -> None:
        self.model = model
        self.loop = loop

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        if _running_loop() is self.loop:
            raise RuntimeError("a Triton pass waits for the event loop: call it from a thread")
        cap = self.model.settings.timeout_s
        left = deadline.remaining()
        wait_s = (cap if left is None else min(max(left, 0.0), cap)) + LOOP_SLACK_S
        pending = asyncio.run_coroutine_threadsafe(self.model.infer(feeds, [OUTPUT]), self.loop)
        try:
            return pending.result(wait_s)[OUTPUT]
        except concurrent.futures.TimeoutError:
            pending.cancel()
            raise local_error(
                status(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no answer from Triton's {self.model.settings.model!r} within {wait_s:.1f} s",
                    reason="TRITON_NO_ANSWER",
                )
            ) from None


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
