"""minilm-late-interaction with its transformer on Triton Inference Server.

Only the forward passes leave the process: tokenizing, padding and the scoring arithmetic
are the in-process scorer's own (late_interaction.py) and run on the service's model
thread, so both backends score alike. The passes are ModelInfer calls made from the
handler's task, each within the RPC's remaining deadline, so an RPC that ends early (its
deadline passed, its caller gone) cancels the pass on Triton and sends no more.

A request's passes go one at a time. A Triton model instance runs its requests one after
another anyway, and concurrency comes from the rerank requests in flight together (and
the model's instance count), so little is lost, and much is kept simple and fair: other
requests' passes interleave with a large request's instead of queueing behind all of it;
the circuit breaker sees one call at a time, so a late request is one timeout rather than
one per pass, a failure stops the request, and while half-open a request's passes are
trial calls that run to their end. Triton's model skips a pass cancelled while it waited
in Triton's queue.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from pathlib import Path

import numpy as np

from mesh.config import MeshSettings
from mesh.triton import TritonModel
from services.rerank.late_interaction import LateInteraction, Pass
from services.rerank.settings import RerankSettings

OUTPUT = "token_embeddings"


class TritonScorer(LateInteraction):
    """Built on the event loop that will call it: its Triton client belongs to that loop."""

    def __init__(self, path: Path, settings: RerankSettings, mesh: MeshSettings) -> None:
        assert settings.triton is not None  # the settings' validator requires it
        super().__init__(path, settings)
        self.model = TritonModel(settings.triton, mesh)

    async def score(self, query: str, documents: list[str], cpu: Executor) -> list[float]:
        """Native scores; tokenizing and arithmetic on `cpu`, the passes on Triton."""
        loop = asyncio.get_running_loop()
        plan = await loop.run_in_executor(cpu, self.plan, query, documents)
        hidden = [await self._forward(one_pass) for one_pass in plan.passes]
        return await loop.run_in_executor(cpu, self.scores, plan, hidden)

    async def _forward(self, one_pass: Pass) -> np.ndarray:
        outputs = await self.model.infer(
            {"input_ids": one_pass.input_ids, "attention_mask": one_pass.attention_mask},
            [OUTPUT],
        )
        return outputs[OUTPUT]
