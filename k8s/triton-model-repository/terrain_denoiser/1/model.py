"""Triton Python-backend model: the terrain UNet's ONNX file on ONNX Runtime.

It runs inside Triton's Python stub, with numpy and onnxruntime from Triton's own Python
environment, not aimesh's: it imports nothing from aimesh. The file is checked against the
sha256 in config.pbtxt before it loads, so Triton never reports ready with another graph
than the one the service's in-process path pins.
"""

import hashlib
import json
from pathlib import Path

import onnxruntime
import triton_python_backend_utils as pb_utils

INPUTS = ("noisy", "sigma", "difficulty")
OUTPUT = "denoised"


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {
            key: value["string_value"] for key, value in config.get("parameters", {}).items()
        }
        graph = Path(args["model_repository"]) / args["model_version"] / "model.onnx"
        digest = hashlib.sha256(graph.read_bytes()).hexdigest()
        if digest != parameters["sha256"]:
            raise pb_utils.TritonModelException(
                f"{graph} has sha256 {digest}, not the pinned {parameters['sha256']}"
            )
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = int(parameters.get("intra_op_threads", "0"))
        self.session = onnxruntime.InferenceSession(str(graph), options, providers=_providers(args))

    def execute(self, requests):
        responses = []
        for request in requests:
            feeds = {
                name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name in INPUTS
            }
            (denoised,) = self.session.run([OUTPUT], feeds)
            output = pb_utils.Tensor(OUTPUT, denoised)
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
        return responses


def _providers(args):
    """CUDA on a GPU instance, named explicitly: with onnxruntime-gpu, TensorRT would come
    first in the available providers and build engines at load."""
    if args["model_instance_kind"] == "GPU":
        device = {"device_id": int(args["model_instance_device_id"])}
        return [("CUDAExecutionProvider", device), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]
