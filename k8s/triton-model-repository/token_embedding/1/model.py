"""Triton Python-backend model: rerank's exported token-vector graph on ONNX Runtime.

It runs inside Triton's Python stub, with numpy and onnxruntime from Triton's own Python
environment, not aimesh's: it imports nothing from aimesh. A rerank request whose caller
has gone or whose deadline has passed cancels its pass; one that was still waiting in
Triton's queue is answered CANCELLED here without running.
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
        responses = []
        for request in requests:
            if request.is_cancelled():
                error = pb_utils.TritonError(
                    "cancelled by its client", pb_utils.TritonError.CANCELLED
                )
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()
            (states,) = self.session.run(None, {"input_ids": ids, "attention_mask": mask})
            output = pb_utils.Tensor("token_embeddings", states.astype(np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
        return responses


def _providers(args):
    """CUDA on a GPU instance, named explicitly: with onnxruntime-gpu, TensorRT would come
    first in the available providers and build engines at load."""
    if args["model_instance_kind"] == "GPU":
        device = {"device_id": int(args["model_instance_device_id"])}
        return [("CUDAExecutionProvider", device), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]
