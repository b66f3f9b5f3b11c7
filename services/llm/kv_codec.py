"""KV cache <-> KvChunk messages: raw little-endian tensor bytes, dtype and shape, no pickle.

Two kinds of KV travel: the torch engine's per-layer K and V tensors, and an engine's
opaque sequence state (llama.cpp's `llama_state_seq_get_data` bytes, a SequenceState) as
KV_PART_STATE chunks. A receiver rebuilds what the handle announced as chunks arrive and
checks that nothing is missing: sequence numbers are contiguous, every byte is covered,
and the stream ended with PullComplete.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class SequenceState:
    """One sequence's KV in its engine's own format, carried as bytes without looking in."""

    data: bytes
    num_tokens: int


KvState = list[LayerKV] | SequenceState


def kv_nbytes(kv: KvState) -> int:
    if isinstance(kv, SequenceState):
        return len(kv.data)
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def kv_tokens(kv: KvState) -> int:
    return kv.num_tokens if isinstance(kv, SequenceState) else kv[0][0].shape[1]


def handle_fields(kv: KvState, kv_format: kv_cache_pb2.KvFormat) -> dict[str, Any]:
    """The KvHandle fields that say what `kv` is: its format (with a state's size), and a
    torch KV's tensor shape and dtype."""
    if isinstance(kv, SequenceState):
        described = kv_cache_pb2.KvFormat()
        described.CopyFrom(kv_format)
        described.state_bytes = len(kv.data)
        return {"format": described}
    keys = kv[0][0]
    return {
        "format": kv_format,
        "num_layers": len(kv),
        "num_kv_heads": keys.shape[0],
        "head_dim": keys.shape[2],
        "dtype": dtype_name(keys.dtype),
    }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def clamp_chunk_bytes(requested: int) -> int:
    if requested <= 0:
        return DEFAULT_CHUNK_BYTES
    return max(MIN_CHUNK_BYTES, min(requested, MAX_CHUNK_BYTES))


def _raw(tensor: torch.Tensor) -> bytes:
    # As bytes: numpy, which copies them out, has no bfloat16.
    return tensor.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _pieces(kv: KvState) -> Iterator[tuple[int, int, str, list[int], bytes]]:
    """(layer, part, dtype, shape, bytes) of each piece, in stream order."""
    if isinstance(kv, SequenceState):
        yield 0, kv_cache_pb2.KV_PART_STATE, "uint8", [len(kv.data)], kv.data
        return
    for layer, (keys, values) in enumerate(kv):
        for part, tensor in (
            (kv_cache_pb2.KV_PART_KEY, keys),
            (kv_cache_pb2.KV_PART_VALUE, values),
        ):
            yield layer, part, dtype_name(tensor.dtype), list(tensor.shape), _raw(tensor)


def encode(kv: KvState, chunk_bytes: int) -> Iterator[kv_cache_pb2.KvChunk]:
    sequence = 0
    for layer, part, dtype, shape, data in _pieces(kv):
        for offset in range(0, max(len(data), 1), chunk_bytes):
            yield kv_cache_pb2.KvChunk(
                sequence=sequence,
                layer=layer,
                part=part,
                dtype=dtype,
                shape=shape,
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


class StateAssembler:
    """Collects KV_PART_STATE chunks into one SequenceState of the announced size."""

    def __init__(self, state_bytes: int, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self._buffer = bytearray(state_bytes)
        self._next_sequence = 0
        self.total_bytes = 0

    def add(self, chunk: kv_cache_pb2.KvChunk) -> None:
        if chunk.sequence != self._next_sequence:
            raise ValueError(f"chunk {chunk.sequence} arrived, expected {self._next_sequence}")
        if chunk.part != kv_cache_pb2.KV_PART_STATE or chunk.layer != 0:
            raise ValueError(f"chunk {chunk.sequence} is no sequence state")
        if tuple(chunk.shape) != (len(self._buffer),):
            raise ValueError(f"chunk {chunk.sequence} has shape {chunk.shape}")
        end = chunk.byte_offset + len(chunk.data)
        if chunk.byte_offset != self.total_bytes or end > len(self._buffer):
            raise ValueError(f"chunk {chunk.sequence} does not continue the state")
        self._buffer[chunk.byte_offset : end] = chunk.data
        self._next_sequence += 1
        self.total_bytes = end

    def finish(self, complete: kv_cache_pb2.PullComplete) -> SequenceState:
        if complete.num_chunks != self._next_sequence or complete.total_bytes != self.total_bytes:
            raise ValueError("PullComplete does not match the chunks received")
        if self.total_bytes != len(self._buffer):
            raise ValueError("KV stream ended before the state was complete")
        return SequenceState(bytes(self._buffer), self.num_tokens)
