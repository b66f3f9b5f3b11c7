"""Which models the gateway serves, and whether it can serve now: read from the
dependencies themselves (readiness, and GetInfo's model names), never configured twice.

The generation service's models answer chat and completions, the embedder's answer
embeddings, diffusion's answer image generations, rerank's answer /v1/rerank. A dependency
that restarts with another model is seen at the next refresh. The gateway is ready while
generation and the embedder are; diffusion and rerank are optional (a mesh without them
serves text and embeddings, and their models appear once they answer).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from mesh.health import probe
from mesh.info import get_info
from mesh.tls import TlsSettings
from services.gateway.errors import model_not_found

# Dependency -> the API surface its models serve.
SURFACES = {
    "generation": "chat",
    "embedder": "embedding",
    "diffusion": "image",
    "rerank": "rerank",
}
# The dependencies readiness waits for.
REQUIRED = frozenset({"generation", "embedder"})


@dataclass
class Catalog:
    """Model names by surface, and whether every dependency was ready at the last look."""

    targets: dict[str, str]
    tls: TlsSettings | None = None
    models: dict[str, list[str]] = field(default_factory=dict)
    # GetInfo's limits by model name (context length, architecture...), for /v1/models.
    limits: dict[str, dict[str, str]] = field(default_factory=dict)
    ready: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def serving(self, surface: str) -> list[str]:
        return self.models.get(surface, [])

    def require(self, surface: str, model: str) -> None:
        """404 in OpenAI's words unless `model` serves `surface`."""
        known = self.serving(surface)
        if model not in known:
            raise model_not_found(model, known)

    async def _look(self, name: str, target: str) -> list[str] | None:
        """The dependency's model names when it is ready; None when it is not. The probes
        go around the mesh channel (as the generation router's do), so a dependency still
        starting trips no circuit breaker."""
        ready, info = await asyncio.gather(
            probe(target, name, tls=self.tls), get_info(target, tls=self.tls)
        )
        if ready != "SERVING" or info is None or not info.models:
            return None
        for model in info.models:
            self.limits[model.name] = dict(model.limits)
        return [model.name for model in info.models]

    async def refresh(self) -> bool:
        """Reads every dependency once; ready only if all of them are."""
        names = list(self.targets)
        looks = await asyncio.gather(*(self._look(n, self.targets[n]) for n in names))
        for name, found in zip(names, looks, strict=True):
            if found is not None:
                self.models[SURFACES[name]] = found
        self.ready = all(
            found is not None for name, found in zip(names, looks, strict=True) if name in REQUIRED
        )
        return self.ready

    def as_openai(self) -> list[dict[str, object]]:
        """GET /v1/models: every model once; an LLM with vLLM's max_model_len and, as
        llama-server's `meta`, what its service reports of it (architecture, context...)."""
        names = dict.fromkeys(n for surface in SURFACES.values() for n in self.serving(surface))
        return [self._card(name) for name in names]

    def _card(self, name: str) -> dict[str, object]:
        card: dict[str, object] = {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "aimesh",
        }
        limits = self.limits.get(name, {})
        if limits.get("max_seq_len", "").isdigit():
            card["max_model_len"] = int(limits["max_seq_len"])
        if limits:
            card["meta"] = limits
        return card
