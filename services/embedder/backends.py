"""Three ways to run the pooled transformer: torch and ONNX Runtime in this process (on a
graph exported once from the same torch module), and Triton Inference Server.

All take padded token ids and return mean-pooled, unnormalised vectors; tokenizing,
batching and normalising happen above them and are shared. torch is imported only where
it is needed: an ONNX Runtime process whose graph is already built never loads it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import numpy as np
import onnxruntime

from mesh.artifacts import build_once
from mesh.config import MeshSettings
from mesh.triton import TritonModel, TritonSettings
from services.embedder.model import SentenceModel
from services.shared.minilm import export_onnx

log = logging.getLogger(__name__)

ONNX_DIRECTORY = "all-MiniLM-L6-v2-onnx"
ONNX_FILE = "model.onnx"
_GPU_PROVIDER = "CUDAExecutionProvider"
_CPU_PROVIDER = "CPUExecutionProvider"


class Backend(Protocol):
    def pool(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """int64 [batch, tokens] twice -> float32 [batch, dimensions], unnormalised."""
        ...


class TorchBackend:
    def __init__(self, model: SentenceModel, threads: int) -> None:
        # Imported here: see the module docstring.
        import torch

        from services.embedder.pooled import load_pooled

        torch.set_num_threads(threads)
        self._torch = torch
        self._module = load_pooled(model)

    def pool(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        with self._torch.inference_mode():
            pooled = self._module(
                self._torch.from_numpy(input_ids), self._torch.from_numpy(attention_mask)
            )
        return pooled.numpy()


class OnnxBackend:
    def __init__(self, graph: Path, threads: int) -> None:
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        # The -gpu wheel lists CUDA even on a machine without a GPU, logs why it cannot
        # load it and falls back to the CPU: the log below says what the session really got.
        wanted = [_CPU_PROVIDER]
        if _GPU_PROVIDER in onnxruntime.get_available_providers():
            wanted.insert(0, _GPU_PROVIDER)
        self._session = onnxruntime.InferenceSession(str(graph), options, providers=wanted)
        self.providers = self._session.get_providers()
        log.info(
            "onnx runtime session",
            extra={"graph": str(graph), "requested": wanted, "providers": self.providers},
        )

    def pool(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        (pooled,) = self._session.run(
            None, {"input_ids": input_ids, "attention_mask": attention_mask}
        )
        return pooled


class TritonBackend:
    """The same pooled model on Triton: asynchronous, so passes run concurrently and a
    cancelled or late request cancels its ModelInfer instead of occupying a thread."""

    OUTPUT = "sentence_embedding"

    def __init__(self, settings: TritonSettings, mesh: MeshSettings) -> None:
        self.model = TritonModel(settings, mesh)

    async def pool(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        outputs = await self.model.infer(
            {"input_ids": input_ids, "attention_mask": attention_mask}, [self.OUTPUT]
        )
        return outputs[self.OUTPUT]


def onnx_graph(model: SentenceModel, cache_dir: Path) -> Path:
    """The exported graph's verified path, exporting (or re-exporting a corrupt one) first."""
    target = cache_dir / "models" / ONNX_DIRECTORY
    build_once(target, lambda scratch: _export(model, scratch / ONNX_FILE), str(model.path))
    return target / ONNX_FILE


def _export(model: SentenceModel, path: Path) -> None:
    from services.embedder.pooled import load_pooled

    export_onnx(load_pooled(model), path, "sentence_embedding", model.max_tokens)
