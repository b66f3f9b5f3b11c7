"""Triton Python-backend model: a transformers causal LM streaming one token per response.

Decoupled: execute() hands each request to a thread of its own and returns at once, so
several generations stream concurrently and a slow reader never blocks another request.
Each step first asks Triton whether the request was cancelled (the client went away, its
deadline passed, or it cancelled the stream) and stops there: a cancelled generation costs
at most one more forward pass. It imports nothing from aimesh; torch and transformers (5.x:
the `cache` argument) come from Triton's own Python environment.
"""

import json
import threading
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModelForCausalLM

_SEED_STRIDE = 1_000_003
_SEED_MOD = 2**63 - 1


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        gpu = args["model_instance_kind"] == "GPU" and torch.cuda.is_available()
        self.device = torch.device(f"cuda:{args['model_instance_device_id']}" if gpu else "cpu")
        dtype = parameters.get("dtype", "auto")
        if dtype == "auto":
            dtype = "bfloat16" if gpu else "float32"
        path = Path(args["model_repository"]) / args["model_version"] / "model"
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else eos or [])
        self.vocab_size = self.model.config.vocab_size
        self.max_positions = self.model.config.max_position_embeddings
        self.slots = threading.Semaphore(int(parameters.get("max_concurrent", "8")))
        self.threads: set[threading.Thread] = set()
        self.logger = pb_utils.Logger

    def execute(self, requests):
        for request in requests:
            thread = threading.Thread(target=self._serve, args=(request,), daemon=True)
            self.threads.add(thread)
            thread.start()
        return None

    def finalize(self):
        for thread in list(self.threads):
            thread.join(timeout=10)

    def _serve(self, request):
        sender = request.get_response_sender()
        try:
            with self.slots:
                self._generate(request, sender)
        except _Refused as refused:
            error = pb_utils.TritonError(str(refused), pb_utils.TritonError.INVALID_ARG)
            sender.send(pb_utils.InferenceResponse(error=error), flags=_FINAL)
        except Exception as failure:  # the stream must end, whatever went wrong
            self.logger.log_error(f"text_generation {request.request_id()}: {failure!r}")
            error = pb_utils.TritonError(f"generation failed: {failure}")
            sender.send(pb_utils.InferenceResponse(error=error), flags=_FINAL)
        finally:
            self.threads.discard(threading.current_thread())

    def _generate(self, request, sender):
        prompt = _input(request, "input_ids")
        max_new_tokens = int(_input(request, "max_new_tokens")[0])
        options = _Options.read(request)
        if prompt.size == 0 or prompt.min() < 0 or prompt.max() >= self.vocab_size:
            raise _Refused(f"input_ids must be 1 or more ids below {self.vocab_size}")
        if max_new_tokens < 1 or prompt.size + max_new_tokens > self.max_positions:
            raise _Refused(
                f"max_new_tokens must be 1 to {self.max_positions - prompt.size} "
                f"for a {prompt.size}-token prompt"
            )
        history = prompt.tolist()
        next_input = torch.tensor([history], device=self.device)
        cache = None
        for index in range(max_new_tokens):
            if request.is_cancelled():
                self.logger.log_info(
                    f"text_generation {request.request_id()}: cancelled after {index} tokens"
                )
                error = pb_utils.TritonError("cancelled", pb_utils.TritonError.CANCELLED)
                sender.send(pb_utils.InferenceResponse(error=error), flags=_FINAL)
                return
            with torch.inference_mode():
                out = self.model(input_ids=next_input, cache=cache, use_cache=True)
                token = options.pick(out.logits[0, -1].float().cpu(), history, index)
            cache = out.cache
            history.append(token)
            if token in self.eos_ids and not options.ignore_eos:
                sender.send(_response([], "eos"), flags=_FINAL)
                return
            if index + 1 == max_new_tokens:
                sender.send(_response([token], "length"), flags=_FINAL)
                return
            sender.send(_response([token], None))
            next_input = torch.tensor([[token]], device=self.device)


_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _Refused(ValueError):
    """The request asks for something this model cannot do: INVALID_ARG to the client."""


class _Options:
    """Sampling as aimesh's in-process engine does it: greedy at temperature 0, otherwise
    top-k then top-p, each token drawn with a generator seeded from (seed, index)."""

    def __init__(self, temperature, top_k, top_p, seed, penalties, ignore_eos):
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.seed = seed
        self.repetition_penalty, self.frequency_penalty = penalties
        self.ignore_eos = ignore_eos

    @classmethod
    def read(cls, request):
        def scalar(name, default):
            value = _optional(request, name)
            return default if value is None else value[0].item()

        options = cls(
            float(scalar("temperature", 0.0)),
            int(scalar("top_k", 0)),
            float(scalar("top_p", 1.0)),
            int(scalar("seed", 0)),
            (float(scalar("repetition_penalty", 1.0)), float(scalar("frequency_penalty", 0.0))),
            bool(scalar("ignore_eos", False)),
        )
        if not (np.isfinite(options.temperature) and options.temperature >= 0):
            raise _Refused("temperature must be a finite number >= 0")
        if options.top_k < 0 or not (0.0 < options.top_p <= 1.0):
            raise _Refused("top_k must be >= 0 and top_p in (0, 1]")
        if not (np.isfinite(options.repetition_penalty) and options.repetition_penalty >= 0.01):
            raise _Refused("repetition_penalty must be a finite number >= 0.01")
        if not np.isfinite(options.frequency_penalty):
            raise _Refused("frequency_penalty must be a finite number")
        return options

    def pick(self, logits, history, index):
        if self.repetition_penalty != 1.0:
            seen = torch.unique(torch.tensor(history))
            chosen = logits[seen]
            logits[seen] = torch.where(
                chosen > 0, chosen / self.repetition_penalty, chosen * self.repetition_penalty
            )
        if self.frequency_penalty != 0.0:
            counts = torch.bincount(torch.tensor(history), minlength=logits.shape[-1])
            logits -= self.frequency_penalty * counts.to(logits.dtype)
        if self.temperature == 0.0:
            return int(torch.argmax(logits))
        # Shifted to a maximum of 0 first, so a tiny temperature means greedy, not NaN.
        logits = (logits - logits.max()) / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            logits[logits < torch.topk(logits, self.top_k).values[-1]] = float("-inf")
        if self.top_p < 1.0:
            ordered, order = torch.sort(logits, descending=True)
            probabilities = torch.softmax(ordered, dim=-1)
            drop = probabilities.cumsum(-1) - probabilities >= self.top_p
            logits[order[drop]] = float("-inf")
        generator = torch.Generator().manual_seed((self.seed * _SEED_STRIDE + index) % _SEED_MOD)
        return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def _input(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)


def _optional(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)


def _response(tokens, finish_reason):
    outputs = [pb_utils.Tensor("output_ids", np.array(tokens, dtype=np.int64))]
    if finish_reason is not None:
        outputs.append(pb_utils.Tensor("finish_reason", np.array([finish_reason], dtype=object)))
    return pb_utils.InferenceResponse(output_tensors=outputs)
