"""One test for "this failure was the allocator saying no", for every engine.

Written here because no library answers it: torch raises OutOfMemoryError on a GPU but a
plain RuntimeError from its CPU allocator, numpy raises MemoryError, and ONNX Runtime has
no type of its own for it, only its allocator's message.
"""

from __future__ import annotations

import torch

ALLOCATOR_MESSAGES = ("out of memory", "can't allocate memory", "failed to allocate memory")


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError | torch.OutOfMemoryError):
        return True
    message = str(error).lower()
    return any(text in message for text in ALLOCATOR_MESSAGES)
