"""The one out-of-memory test, for every allocator's way of saying no."""

from __future__ import annotations

import pytest
import torch

from services.shared.memory import is_out_of_memory

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
        ),
        RuntimeError("onnxruntime: Failed to allocate memory for requested buffer of size 1e9"),
    ],
)
def test_allocator_failures_are_out_of_memory(error):
    assert is_out_of_memory(error)


@pytest.mark.parametrize("error", [RuntimeError("shape mismatch"), ValueError("bad"), KeyError()])
def test_other_failures_are_not(error):
    assert not is_out_of_memory(error)
