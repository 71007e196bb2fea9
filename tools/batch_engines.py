"""The engines `llama32 batch` drives, all behind the batch request API (refimpl.batch_api).

- accel: accel.batch.BatchEngine, continuous batching over a paged KV cache (GPU, or torch ops on CPU).
- refimpl: the NumPy reference engine behind the same API, one request at a time (`OneAtATime`): the oracle, and
  the path that runs without torch.

Each request names its adapter (`--lora NAME=DIR`, None: the base model). accel applies them unmerged, several in
one step (BatchEngine.add_adapter); refimpl runs each adapter's requests on an engine over a copy of the weights with
that adapter merged in (fp32), one adapter's requests after another.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from refimpl.errors import GenerationError
from refimpl.batch_api import RequestOutput, SamplingParams
from refimpl.generate import Sampling


@dataclass
class _Running:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    images: object = None  # a vision model's ImageInputs
    tokens: list[int] = field(default_factory=list)
    stream: object = None
    stop_ids: frozenset = frozenset()


class OneAtATime:
    """A single-sequence engine (refimpl.generate.RefEngine's `generate`) behind the batch API: each step decodes one
    token of the request in progress; when it ends the next starts, one under the same adapter first.
    engine_for(adapter name or None) builds an adapter's engine: one at a time is held, each built once a run.
    eos_ids: the checkpoint's end-of-sequence ids, which stop a request unless it asks `ignore_eos` (its own
    stop_token_ids stop it either way, as in the batch engine)."""

    def __init__(self, engine_for, eos_ids=()):
        self.engine_for = engine_for
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.engine, self.adapter = None, None  # the engine held and its adapter
        self.queue: list[_Running] = []
        self.active: _Running | None = None
        self.counter = 0

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    adapter: str | None = None, images=None) -> str:
        rid = request_id if request_id is not None else str(self.counter)
        self.counter += 1
        self.queue.append(_Running(rid, list(prompt_ids), params, adapter, images))
        return rid

    def abort(self, request_id: str) -> None:
        self.queue = [r for r in self.queue if r.id != request_id]
        if self.active is not None and self.active.id == request_id:
            self.active = None

    def has_unfinished(self) -> bool:
        return bool(self.queue) or self.active is not None

    def stats(self) -> dict:
        return {"waiting": len(self.queue), "running": int(self.active is not None)}

    def _start(self) -> _Running:
        """The next request (the first under the held engine's adapter, else the oldest), its engine ready."""
        held = [r for r in self.queue if self.engine is not None and r.adapter == self.adapter]
        r = (held or self.queue)[0]
        self.queue.remove(r)
        if self.engine is None or r.adapter != self.adapter:
            self.engine = None  # the held engine's memory goes before the next one is built
            self.engine, self.adapter = self.engine_for(r.adapter), r.adapter
        p = r.params
        s = Sampling(p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.repetition_penalty)
        images = {} if r.images is None else {"images": r.images}  # a vision engine's keyword
        r.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids)
        r.stream = self.engine.generate(r.prompt_ids, s, stop_ids=r.stop_ids,
                                        **images)
        return r

    def step(self) -> list[RequestOutput]:
        if self.active is None:
            if not self.queue:
                return []
            self.active = self._start()
        r = self.active
        token = next(r.stream)
        r.tokens.append(token)
        reason = ("stop" if token in r.stop_ids
                  else "length" if len(r.tokens) >= r.params.max_tokens else None)
        if reason:
            self.active = None
        return [RequestOutput(r.id, [token], list(r.tokens), reason is not None, reason, len(r.prompt_ids))]


def batch_engine(ckpt, backend: str, device=None, dtype=None, adapters: dict | None = None, **options):
    """The batch engine over `ckpt` (a refimpl Checkpoint, base weights) serving `adapters` ({NAME: load_lora's
    list}) to the requests that name them."""
    adapters = adapters or {}
    if backend == "refimpl":
        from tools.engines import engine_for

        def adapter_engine(name):
            return engine_for(with_adapter(ckpt, adapters.get(name)), "refimpl", device, dtype)
        return OneAtATime(adapter_engine, ckpt.stop_ids)
    try:
        from accel.batch import BatchEngine
    except ImportError as e:
        raise GenerationError(f"--backend accel: the batch engine is not available here ({e})") from None
    engine = BatchEngine.from_checkpoint(ckpt, device=device, dtype=dtype, **options)
    for name, adapter in adapters.items():
        engine.add_adapter(name, adapter)
    return engine


def with_adapter(ckpt, adapter):
    """A checkpoint whose weights have `adapter` (refimpl.formats.lora.load_lora's list) merged in (fp32); `ckpt`
    itself is untouched."""
    if adapter is None:
        return ckpt
    from refimpl.formats.lora import merge_lora
    return replace(ckpt, params=merge_lora(ckpt.params, ckpt.config, adapter))
