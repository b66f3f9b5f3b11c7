"""diffusion: image generation jobs (digits DDPM, terrain ONNX UNet) with streamed progress."""

from mesh.authz import EDGE, OPERATOR
from mesh.registry import ServiceSpec

SPEC = ServiceSpec(
    name="diffusion",
    default_port=50080,
    description="Diffusion: per-job streams of queue position, steps, previews and images",
    setup="services.diffusion.servicer:setup",
    options="services.diffusion.settings:DiffusionSettings",
    # Calls are admitted at once and wait in the job queue, which reports their position
    # and holds compute slots and memory ([services.diffusion] slots, max_queued_jobs).
    max_concurrency=256,
    # Cancel must reach a job while every slot is busy; ListModels is a cheap lookup.
    exempt_methods=(
        "/aimesh.diffusion.v1.DiffusionService/Cancel",
        "/aimesh.diffusion.v1.DiffusionService/ListModels",
    ),
    edge_services=("aimesh.diffusion.v1.DiffusionService",),
    callers=(("aimesh.diffusion.v1.DiffusionService", (EDGE, OPERATOR, "gateway", "tools")),),
    scopes=(
        ("aimesh.diffusion.v1.DiffusionService", "images"),
        ("/aimesh.diffusion.v1.DiffusionService/ListModels", "read"),
    ),
)
