"""Triton Python-backend model: the embedder's exported ONNX graph on ONNX Runtime.

It runs inside Triton's Python stub, with numpy and onnxruntime from Triton's own Python
environment, not aimesh's: it imports nothing from aimesh.
"""

import json
from pathlib import Path

import numpy as np
import onnxruntime
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = config.get("parameters", {})
        threads = int(parameters.get("intra_op_threads", {}).get("string_value", "1"))
        graph = Path(args["model_repository"]) / args["model_version"] / "model.onnx"
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(str(graph), options, providers=_providers(args))

    def execute(self, requests):
        # Requests of one dynamic batch are padded by their callers, so only those of equal
        # length run as one pass; ONNX Runtime batches the rows inside it.
        by_length = {}
        for index, request in enumerate(requests):
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()
            by_length.setdefault(ids.shape[1], []).append((index, ids, mask))
        responses = [None] * len(requests)
        for group in by_length.values():
            (pooled,) = self.session.run(
                None,
                {
                    "input_ids": np.concatenate([ids for _, ids, _ in group]),
                    "attention_mask": np.concatenate([mask for _, _, mask in group]),
                },
            )
            row = 0
            for index, ids, _ in group:
                rows = pooled[row : row + len(ids)].astype(np.float32)
                row += len(ids)
                output = pb_utils.Tensor("sentence_embedding", rows)
                responses[index] = pb_utils.InferenceResponse(output_tensors=[output])
        return responses


def _providers(args):
    """CUDA on a GPU instance, named explicitly: with onnxruntime-gpu, TensorRT would come
    first in the available providers and build engines at load."""
    if args["model_instance_kind"] == "GPU":
        device = {"device_id": int(args["model_instance_device_id"])}
        return [("CUDAExecutionProvider", device), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]
