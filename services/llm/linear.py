"""Projections whose weights are laid out once for the CPU's matrix kernel.

On the CPU, `F.linear` hands the plain [out, in] weight to MKL's sgemm, which streams a
weight too big for the cache slowly when only a few rows multiply it. oneDNN with each
weight reordered once into its blocked layout (what torch.compile's CPU backend does when
it prepacks linear weights) does the same work faster: all of SmolLM2-135M's projections
for one decode step, float32, 2 threads, on this project's 2-core AVX2 machine took
72 -> 55 ms for one row, 119 -> 58 ms for 4 and 113 -> 71 ms for 16
(`python -m loadtest.llm_kernels`). The packed weight replaces the plain one, so the
model holds no extra copy.

Where oneDNN cannot run the dtype (bfloat16 needs AVX-512 or AVX-NE-CONVERT) or the weights
live on a GPU, the plain `F.linear` is used and nothing changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def packable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN can run this dtype on this device's CPU."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Projection:
    """y = x W^T for x of shape [rows, in]."""

    def __init__(self, weight: torch.Tensor, packed: bool) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = packed
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight) if packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)
