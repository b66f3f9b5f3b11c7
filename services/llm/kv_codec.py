"""KV cache <-> KvChunk messages: raw little-endian tensor bytes, dtype and shape, no pickle.

A receiver rebuilds each layer's K and V as chunks arrive and checks that nothing is
missing: sequence numbers are contiguous, every byte of every tensor is covered, and the
stream ended with PullComplete.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np
import torch

from aimesh.llm.v1 import kv_cache_pb2
from services.llm.llama import LayerKV

DEFAULT_CHUNK_BYTES = 1024 * 1024
MIN_CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 4 * 1024 * 1024 - 64 * 1024

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("the KV wire format is little-endian; this host is not")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def clamp_chunk_bytes(requested: int) -> int:
    if requested <= 0:
        return DEFAULT_CHUNK_BYTES
    return max(MIN_CHUNK_BYTES, min(requested, MAX_CHUNK_BYTES))


def _raw(tensor: torch.Tensor) -> bytes:
    # As bytes: numpy, which copies them out, has no bfloat16.
    return tensor.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def encode(kv: list[LayerKV], chunk_bytes: int) -> Iterator[kv_cache_pb2.KvChunk]:
    sequence = 0
    for layer, (keys, values) in enumerate(kv):
        for part, tensor in (
            (kv_cache_pb2.KV_PART_KEY, keys),
            (kv_cache_pb2.KV_PART_VALUE, values),
        ):
            data = _raw(tensor)
            for offset in range(0, max(len(data), 1), chunk_bytes):
                yield kv_cache_pb2.KvChunk(
                    sequence=sequence,
                    layer=layer,
                    part=part,
                    dtype=dtype_name(tensor.dtype),
                    shape=list(tensor.shape),
                    byte_offset=offset,
                    data=data[offset : offset + chunk_bytes],
                )
                sequence += 1


class KvAssembler:
    """Collects chunks into per-layer tensors; raises ValueError on anything inconsistent."""

    def __init__(self, num_layers: int, shape: tuple[int, int, int], dtype: str) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"unsupported KV dtype {dtype!r}")
        self.dtype = dtype
        self.shape = shape
        size = int(np.prod(shape)) * torch.empty((), dtype=DTYPES[dtype]).element_size()
        self._size = size
        self._buffers = [[bytearray(size), bytearray(size)] for _ in range(num_layers)]
        self._filled = [[0, 0] for _ in range(num_layers)]
        self._next_sequence = 0
        self.total_bytes = 0

    def add(self, chunk: kv_cache_pb2.KvChunk) -> None:
        if chunk.sequence != self._next_sequence:
            raise ValueError(f"chunk {chunk.sequence} arrived, expected {self._next_sequence}")
        if not 0 <= chunk.layer < len(self._buffers):
            raise ValueError(f"chunk for layer {chunk.layer} of {len(self._buffers)}")
        if chunk.dtype != self.dtype or tuple(chunk.shape) != self.shape:
            raise ValueError(f"chunk {chunk.sequence} has dtype/shape {chunk.dtype}/{chunk.shape}")
        if chunk.part not in (kv_cache_pb2.KV_PART_KEY, kv_cache_pb2.KV_PART_VALUE):
            raise ValueError(f"chunk {chunk.sequence} has no part")
        index = 0 if chunk.part == kv_cache_pb2.KV_PART_KEY else 1
        buffer = self._buffers[chunk.layer][index]
        end = chunk.byte_offset + len(chunk.data)
        if chunk.byte_offset != self._filled[chunk.layer][index] or end > len(buffer):
            raise ValueError(f"chunk {chunk.sequence} does not continue its tensor")
        buffer[chunk.byte_offset : end] = chunk.data
        self._filled[chunk.layer][index] = end
        self._next_sequence += 1
        self.total_bytes += len(chunk.data)

    def finish(self, complete: kv_cache_pb2.PullComplete) -> list[LayerKV]:
        if complete.num_chunks != self._next_sequence or complete.total_bytes != self.total_bytes:
            raise ValueError("PullComplete does not match the chunks received")
        if any(filled != self._size for pair in self._filled for filled in pair):
            raise ValueError("KV stream ended before every tensor was complete")
        dtype = DTYPES[self.dtype]
        return [
            tuple(torch.frombuffer(buffer, dtype=dtype).view(self.shape) for buffer in layer)
            for layer in self._buffers
        ]
