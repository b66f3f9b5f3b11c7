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
        self.session = onnxruntime.InferenceSession(
            str(graph), options, providers=onnxruntime.get_available_providers()
        )

    def execute(self, requests):
        # Requests of one dynamic batch share a shape only if their callers padded alike,
        # so each runs on its own; ONNX Runtime batches the rows inside a request.
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()
            (pooled,) = self.session.run(None, {"input_ids": ids, "attention_mask": mask})
            output = pb_utils.Tensor("sentence_embedding", pooled.astype(np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
        return responses
