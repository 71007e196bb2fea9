"""The engines `llama32 batch` drives, all behind accel.batch.BatchEngine's request API:
`add_request(prompt_ids, params, request_id) -> id`, `step() -> [RequestOutput]`, `abort(id)`, `has_unfinished()`.

- accel: accel.batch.BatchEngine, continuous batching over a paged KV cache (GPU, or torch ops on CPU).
- refimpl: the NumPy reference engine behind the same API, one request at a time (`OneAtATime`): the oracle, and
  the path that runs without torch.

An adapter (`--lora NAME=DIR`) is merged (fp32) into a copy of the base weights, and its requests run on an engine
over that copy: the request loop runs one adapter's requests at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from refimpl.errors import GenerationError
from refimpl.generate import Sampling


@dataclass(frozen=True)
class Params:
    """accel.batch.SamplingParams' fields, for the engines that run without torch."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class Output:
    """accel.batch.RequestOutput's fields."""

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int


@dataclass
class _Running:
    id: str
    prompt_ids: list[int]
    params: Params
    tokens: list[int] = field(default_factory=list)
    stream: object = None


class OneAtATime:
    """A single-sequence engine (refimpl.generate.RefEngine's `generate`) behind the batch API: each step decodes one
    token of the oldest unfinished request; the next request starts when it ends."""

    def __init__(self, engine):
        self.engine, self.queue, self.counter = engine, [], 0

    def add_request(self, prompt_ids: list[int], params: Params, request_id: str | None = None) -> str:
        rid = request_id if request_id is not None else str(self.counter)
        self.counter += 1
        self.queue.append(_Running(rid, list(prompt_ids), params))
        return rid

    def abort(self, request_id: str) -> None:
        self.queue = [r for r in self.queue if r.id != request_id]

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def stats(self) -> dict:
        return {"waiting": max(len(self.queue) - 1, 0), "running": min(len(self.queue), 1)}

    def step(self) -> list[Output]:
        if not self.queue:
            return []
        r = self.queue[0]
        if r.stream is None:
            p = r.params
            s = Sampling(p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.repetition_penalty)
            r.stream = self.engine.generate(r.prompt_ids, s, stop_ids=() if p.ignore_eos else p.stop_token_ids)
        token = next(r.stream)
        r.tokens.append(token)
        reason = ("stop" if token in r.params.stop_token_ids and not r.params.ignore_eos
                  else "length" if len(r.tokens) >= r.params.max_tokens else None)
        if reason:
            self.queue.pop(0)
        return [Output(r.id, [token], list(r.tokens), reason is not None, reason, len(r.prompt_ids))]


@dataclass
class EngineKit:
    """An engine and the SamplingParams type it takes."""

    engine: object
    params_type: type


def batch_engine(ckpt, backend: str, device=None, dtype=None, **options) -> EngineKit:
    """The batch engine over `ckpt` (a refimpl Checkpoint, adapter already merged)."""
    if backend == "refimpl":
        from tools.engines import engine_for
        return EngineKit(OneAtATime(engine_for(ckpt, "refimpl", device, dtype)), Params)
    try:
        from accel.batch import BatchEngine, SamplingParams
    except ImportError as e:
        raise GenerationError(f"--backend accel: the batch engine is not available here ({e})") from None
    return EngineKit(BatchEngine.from_checkpoint(ckpt, device=device, dtype=dtype, **options), SamplingParams)


def with_adapter(ckpt, adapter):
    """A checkpoint whose weights have `adapter` (refimpl.formats.lora.load_lora's list) merged in (fp32); `ckpt`
    itself is untouched."""
    if adapter is None:
        return ckpt
    from refimpl.formats.lora import merge_lora
    return replace(ckpt, params=merge_lora(ckpt.params, ckpt.config, adapter))
