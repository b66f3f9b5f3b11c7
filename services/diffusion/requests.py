"""GenerateRequest -> (model, Plan), or every field violation at once."""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from aimesh.diffusion.v1 import diffusion_pb2
from mesh import request_id
from mesh.validation import Violations
from services.diffusion.engine import DiffusionModel, Plan

MAX_PROMPT_BYTES = 1024
# No model has more than a few conditioning keys; these bound what a refusal echoes.
MAX_CONDITIONING_KEYS = 8
MAX_CONDITIONING_KEY_BYTES = 64
SEED_LIMIT = 2**64


def clipped(text: str, limit: int = 64) -> str:
    """`text` quoted for an error message, cut short: a refusal travels in the trailing
    metadata, which clients cap at a few KiB, so echoing a 300 KB name would turn the
    refusal into the client's RESOURCE_EXHAUSTED."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def check_conditioning(
    conditioning: Mapping[str, float], violations: Violations
) -> Mapping[str, float]:
    """The map if its size and keys are sane enough to hand to a model, else empty (and a
    violation): each unknown key becomes a violation naming it."""
    fits = violations.check(
        len(conditioning) <= MAX_CONDITIONING_KEYS,
        "conditioning",
        f"at most {MAX_CONDITIONING_KEYS} keys, got {len(conditioning)}",
    ) and violations.check(
        all(len(key.encode()) <= MAX_CONDITIONING_KEY_BYTES for key in conditioning),
        "conditioning",
        f"keys must be at most {MAX_CONDITIONING_KEY_BYTES} bytes long",
    )
    return conditioning if fits else {}


def plan_job(
    request: diffusion_pb2.GenerateRequest, models: Mapping[str, DiffusionModel]
) -> tuple[DiffusionModel, Plan]:
    violations = Violations()
    model = models.get(request.model)
    violations.check(
        model is not None,
        "model",
        f"unknown model {clipped(request.model)}; known: {', '.join(sorted(models))}",
    )
    violations.check(request_id.is_valid(request.request_id), "request_id", request_id.RULE)
    prompt_fits = violations.max_length(request.prompt.encode(), "prompt", MAX_PROMPT_BYTES)
    violations.check(request.preview_every_steps >= 0, "preview_every_steps", "must be >= 0")
    if model is None:
        violations.raise_if_any()
    assert model is not None
    card = model.card

    images = request.num_images if request.HasField("num_images") else 1
    steps = request.steps if request.HasField("steps") else card.default_steps
    for field, value, limit in (
        ("num_images", images, card.max_images),
        ("steps", steps, card.max_steps),
    ):
        violations.check(
            1 <= value <= limit, field, f"must be 1 to {limit} for {card.name}, got {value}"
        )
    sampler = request.sampler or card.samplers[0]
    violations.check(
        sampler in card.samplers,
        "sampler",
        f"{card.name} supports {', '.join(diffusion_pb2.Sampler.Name(s) for s in card.samplers)}",
    )
    guidance = card.default_guidance
    if request.HasField("guidance_scale"):
        if card.default_guidance is None:
            violations.add("guidance_scale", f"{card.name} takes no guidance; leave it unset")
        elif violations.in_range(request.guidance_scale, "guidance_scale", 0, card.max_guidance):
            guidance = request.guidance_scale
    size = card.sizes[0]
    if request.width or request.height:
        size = request.width
        violations.check(
            request.width == request.height and request.width in card.sizes,
            "width",
            f"{request.width}x{request.height} is not a size of {card.name}; sizes: "
            + ", ".join(f"{s}x{s}" for s in card.sizes),
        )
    seed = request.seed if request.HasField("seed") else secrets.randbelow(2**63)
    violations.check(
        seed + images <= SEED_LIMIT,
        "seed",
        f"seed + num_images must stay below 2^64 (image k uses seed + k), got {seed}",
    )
    prompt = request.prompt if prompt_fits else ""  # one violation per field is enough
    conditioning = check_conditioning(dict(request.conditioning), violations)
    condition = model.parse_condition(prompt, conditioning, violations)
    violations.raise_if_any()
    return model, Plan(
        condition=condition,
        size=size,
        steps=steps,
        sampler=sampler,
        guidance=guidance,
        seeds=tuple(range(seed, seed + images)),
    )
