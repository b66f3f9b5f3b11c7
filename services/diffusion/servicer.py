"""The diffusion service's gRPC surface: validate, queue with a visible position, stream."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import torch
from opentelemetry import trace

from aimesh.common.v1 import common_pb2
from aimesh.diffusion.v1 import diffusion_pb2, diffusion_pb2_grpc
from mesh import caller
from mesh.failures import Cancelled, OutOfMemory
from mesh.info import ModelInfo
from mesh.server import MeshServer
from mesh.timing import stage
from mesh.triton import TritonModel
from mesh.validation import Violations
from services.diffusion.denoisers import Denoiser, TritonDenoiser
from services.diffusion.engine import DiffusionModel, ModelCard, Plan
from services.diffusion.events import JobEvents
from services.diffusion.jobs import Job, JobQueue
from services.diffusion.metrics import JOBS
from services.diffusion.requests import plan_job
from services.diffusion.runner import RunTimes, Throttle, run_job
from services.diffusion.settings import DiffusionSettings

SERVICE = diffusion_pb2.DESCRIPTOR.services_by_name["DiffusionService"]
log = logging.getLogger(__name__)
MAX_JOB_ID = 64


def model_info(card: ModelCard) -> diffusion_pb2.ModelInfo:
    return diffusion_pb2.ModelInfo(
        name=card.name,
        description=card.description,
        conditioning=card.conditioning,
        width=card.sizes[0],
        height=card.sizes[0],
        max_steps=card.max_steps,
        max_images=card.max_images,
        samplers=card.samplers,
        default_steps=card.default_steps,
        sizes=[diffusion_pb2.Size(width=s, height=s) for s in card.sizes],
        default_guidance_scale=card.default_guidance,  # None: unset, the model takes none
    )


def uses_cuda(settings: DiffusionSettings) -> bool:
    return settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available())


def memory_budget_bytes(settings: DiffusionSettings) -> int:
    if settings.memory_budget_mb is not None:
        return settings.memory_budget_mb * 2**20
    if uses_cuda(settings):
        free, _ = torch.cuda.mem_get_info()
        return int(free * 0.8)
    return psutil.virtual_memory().available // 2


def load_models(
    settings: DiffusionSettings, terrain_denoiser: Denoiser | None = None
) -> dict[str, DiffusionModel]:
    """`terrain_denoiser`: where terrain's passes run when not in this process (Triton)."""
    # Imported here: each pulls in its runtime only when configured.
    from services.diffusion.digits import DigitsModel
    from services.diffusion.terrain import TerrainModel

    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = "cuda" if uses_cuda(settings) else "cpu"
    loaders: dict[str, Callable[[], DiffusionModel]] = {
        "digits": lambda: DigitsModel(device=device),
        "terrain": lambda: TerrainModel(settings.device, settings.threads, terrain_denoiser),
    }
    return {name: loaders[name]() for name in settings.models}


def described(model: DiffusionModel) -> ModelInfo:
    """GetInfo's entry for a loaded model."""
    card = model.card
    return ModelInfo(
        name=card.name,
        **dataclasses.asdict(model.provenance),
        limits={
            "sizes": ",".join(map(str, card.sizes)),
            "max_steps": str(card.max_steps),
            "max_images": str(card.max_images),
        },
    )


class DiffusionServicer(diffusion_pb2_grpc.DiffusionServiceServicer):
    def __init__(self, settings: DiffusionSettings, workers: ThreadPoolExecutor) -> None:
        self.models: dict[str, DiffusionModel] = {}
        self.queue = JobQueue(
            slots=settings.slots,
            budget_bytes=memory_budget_bytes(settings),
            max_queue=settings.max_queued_jobs,
        )
        self.workers = workers
        self.throttle = Throttle(settings.progress_min_interval_s, settings.preview_min_interval_s)

    async def Generate(
        self, request: diffusion_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[diffusion_pb2.GenerateResponse]:
        received = time.perf_counter()
        model, plan = plan_job(request, self.models)
        job = Job(
            model, plan, model.estimate_bytes(len(plan.seeds), plan.size), owner=caller.current()
        )
        span = trace.get_current_span()
        span.set_attribute("gen_ai.request.model", model.card.name)
        span.set_attribute("aimesh.diffusion.job_id", job.id)
        self.queue.submit(job)
        # Set once a worker owns the job: from then on only the worker's return frees its
        # slot; until then, leaving this handler by any path must free it.
        running: asyncio.Future[RunTimes] | None = None
        outcome = "cancelled"  # unless it ends otherwise; a caller that left raises no error
        try:
            position: int | None = None
            while position != 0:  # 0: the job holds a slot
                position = await self.queue.next_position(job, position)
                yield diffusion_pb2.GenerateResponse(
                    queued=diffusion_pb2.Queued(job_id=job.id, position=position)
                )
            started = time.perf_counter()
            loop = asyncio.get_running_loop()
            events = JobEvents(loop, len(plan.seeds))
            work = functools.partial(
                run_job,
                job,
                events.push,
                preview_every=request.preview_every_steps,
                throttle=self.throttle,
            )
            # In this call's context: the job's passes see its deadline (and trace).
            running = loop.run_in_executor(self.workers, contextvars.copy_context().run, work)
            running.add_done_callback(functools.partial(self._worker_returned, job, events))
            async for event in events.drain():
                yield event
            times = running.result()  # drained: closed once the worker had returned
            outcome = "completed"
            yield summary(job, queue_s=started - received, times=times, received=received)
        except Exception as error:
            if not isinstance(error, Cancelled):  # by Cancel: "cancelled", not "failed"
                outcome = "out_of_memory" if isinstance(error, OutOfMemory) else "failed"
            raise
        finally:
            # The caller left (cancel, deadline, disconnect) or the job ended: a running
            # job stops at its next unit and its worker frees the slot then.
            job.cancel()
            if running is None:
                self.queue.release(job)
            JOBS.labels(model.card.name, outcome).inc()
            log.info(
                "diffusion job ended",
                extra={
                    "job_id": job.id,
                    "request_id": request.request_id,
                    "model": model.card.name,
                    "images": len(plan.seeds),
                    "steps": plan.steps,
                    "size": plan.size,
                    "outcome": outcome,
                    "seconds": round(time.perf_counter() - received, 3),
                },
            )

    def _worker_returned(
        self, job: Job, events: JobEvents, running: asyncio.Future[RunTimes]
    ) -> None:
        """The slot is freed when the worker thread has really returned, never before, and
        whether or not its caller is still there to read the outcome."""
        self.queue.release(job)
        events.close()
        if not running.cancelled():
            running.exception()  # read: a caller that left leaves no "never retrieved" error

    async def Cancel(
        self, request: diffusion_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> diffusion_pb2.CancelResponse:
        violations = Violations()
        violations.check(bool(request.job_id), "job_id", "must name a job (Queued.job_id)")
        violations.max_length(request.job_id, "job_id", MAX_JOB_ID)
        violations.raise_if_any()
        stopped = self.queue.cancel(request.job_id, caller.current())
        return diffusion_pb2.CancelResponse(cancelled=stopped)

    async def ListModels(
        self, request: diffusion_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> diffusion_pb2.ListModelsResponse:
        return diffusion_pb2.ListModelsResponse(
            models=[model_info(model.card) for model in self.models.values()]
        )


def summary(
    job: Job, *, queue_s: float, times: RunTimes, received: float
) -> diffusion_pb2.GenerateResponse:
    timing = common_pb2.Timing(
        stages=[
            stage("queue", queue_s, common_pb2.STAGE_KIND_QUEUE),
            stage("denoise", times.denoise_s, common_pb2.STAGE_KIND_COMPUTE),
            stage("encode", times.encode_s, common_pb2.STAGE_KIND_COMPUTE),
        ],
        total_ns=int((time.perf_counter() - received) * 1e9),
    )
    return diffusion_pb2.GenerateResponse(
        summary=diffusion_pb2.Summary(job_id=job.id, seeds=job.plan.seeds, timing=timing)
    )


def warm_up(model: DiffusionModel) -> None:
    """One step of one image, so the first real job does not pay for lazy initialisation."""
    card = model.card
    condition = model.parse_condition("", {}, Violations())
    plan = Plan(condition, card.sizes[0], 1, card.samplers[0], card.default_guidance, (0,))
    sampling = model.start(plan)
    sampling.advance(0, interrupt=lambda: None)
    sampling.result(0)


async def setup(server: MeshServer) -> DiffusionServicer:
    """Registers the service; returns the servicer so tests can watch its job queue."""
    settings = server.options_as(DiffusionSettings)
    servicer = DiffusionServicer(settings, server.executor("jobs", settings.slots))
    server.add_service(diffusion_pb2_grpc.add_DiffusionServiceServicer_to_server, servicer, SERVICE)

    triton: TritonDenoiser | None = None

    async def load() -> None:
        nonlocal triton
        loop = asyncio.get_running_loop()
        if "terrain" in settings.models and settings.terrain_backend == "triton":
            assert settings.triton is not None  # the settings' validator requires it
            # Not ready until Triton has the model, and only while it has; alive all along.
            model = TritonModel(settings.triton, server.settings)
            await model.wait_until_ready()
            server.add_readiness_probe(model.ready)
            triton = TritonDenoiser(model, loop)  # its passes ride this loop
        models = await loop.run_in_executor(servicer.workers, load_models, settings, triton)
        for model in models.values():
            await loop.run_in_executor(servicer.workers, warm_up, model)
            server.describe(described(model))
        servicer.models = models

    async def shut_down() -> None:
        for job_id in servicer.queue.job_ids():
            servicer.queue.cancel(job_id, None)
        if triton is not None:
            await triton.model.close()

    server.add_warmup(load)
    server.add_shutdown(shut_down)
    return servicer
