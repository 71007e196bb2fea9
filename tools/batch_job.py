"""`llama32 batch`'s work: requests through a batch engine, results written in input order as they complete.

The request loop (`run_group`) takes any engine with the batch request API (refimpl.batch_api), so
the same loop drives the paged continuous-batching engine and the NumPy reference one request at a time.
Stop strings are found in the text as it grows (tools.text_stream, incrementally): the text is cut before the
earliest one, the request aborted, and its finish reason is "stop", as for a stop token.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from refimpl.batch_api import SamplingParams
from refimpl.progress import Progress

from tools.text_stream import TextStream


class OrderedWriter:
    """Writes records in `order` (ids), each as soon as it and every record before it are complete; a file cut
    short therefore holds a prefix of the run."""

    def __init__(self, f, order: list[str]):
        self.f, self.order, self.next, self.held = f, list(order), 0, {}

    def put(self, rid: str, record: dict) -> None:
        self.held[rid] = record
        while self.next < len(self.order) and self.order[self.next] in self.held:
            self.f.write(json.dumps(self.held.pop(self.order[self.next]), ensure_ascii=False) + "\n")
            self.f.flush()
            self.next += 1

    @property
    def complete(self) -> bool:
        return self.next == len(self.order)


@dataclass
class Tally:
    """What the progress bar and the summary report."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    start: float = field(default_factory=time.perf_counter)

    def tokens_per_s(self) -> float:
        elapsed = time.perf_counter() - self.start
        return self.completion_tokens / elapsed if elapsed > 0 else 0.0


def result_record(req, ids: list[int], text: str, reason: str) -> dict:
    return {"id": req.id, "text": text, "generated_ids": ids, "finish_reason": reason,
            "usage": {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(ids)}}


class _Live:
    """One request in flight: the ids it has generated so far and, with stop strings, its text as it grows."""

    def __init__(self, req, tokenizer):
        self.req, self.ids, self.tok = req, [], tokenizer
        self.stream = TextStream(tokenizer, req.stop) if req.stop else None

    def step(self, out) -> dict | None:
        """The engine's output for this request -> its record once it is finished (None: not yet)."""
        self.ids.extend(out.new_token_ids)
        if self.stream is None:
            return result_record(self.req, self.ids, self.tok.decode(self.ids), out.finish_reason) \
                if out.finished else None
        self.stream.push(out.new_token_ids)
        if self.stream.stopped:
            return result_record(self.req, self.ids, self.stream.text, "stop")
        if not out.finished:
            return None
        self.stream.finish()
        return result_record(self.req, self.ids, self.stream.text, out.finish_reason)


def run_group(engine, requests, tokenizer, stop_ids, on_done, tally: Tally, progress: Progress | None = None) -> None:
    """Every request (each under its own adapter) through the engine until all are finished; on_done(request,
    record) as each ends."""
    live = {}
    for req in requests:
        params = SamplingParams(stop_token_ids=tuple(stop_ids), **req.sampling)
        images = {} if req.image_inputs is None else {"images": req.image_inputs}
        live[engine.add_request(req.prompt_ids, params, request_id=req.id, adapter=req.adapter, **images)] = \
            _Live(req, tokenizer)
    while engine.has_unfinished():
        for out in engine.step():
            r = live.get(out.request_id)
            if r is None:  # already finished here by a stop string
                continue
            tally.completion_tokens += len(out.new_token_ids)
            record = r.step(out)
            if record is not None and not out.finished:  # a stop string: the engine would go on
                engine.abort(out.request_id)
            if record is not None:
                del live[out.request_id]
                tally.requests += 1
                tally.prompt_tokens += len(r.req.prompt_ids)
                on_done(r.req, record)
                if progress is not None:
                    progress.advance(1, f"{tally.tokens_per_s():.1f} tok/s")
        if progress is not None:
            progress.advance(0, f"{tally.tokens_per_s():.1f} tok/s")


def answer_losses(engine, requests, tokenizer) -> dict[str, tuple[float, int]]:
    """{id: (mean loss of its answer's tokens, answer tokens)} for every request with an answer, teacher-forced by
    one forward of a single-sequence engine (refimpl's or accel's `steps`) over prompt + answer."""
    import numpy as np

    from refimpl.model.llama import run_steps
    from tools.batch_eval import answer_loss
    out = {}
    for req in requests:
        if req.answer is None:
            continue
        answer_ids = tokenizer.encode(req.answer, add_special_tokens=False)
        ids = (req.prompt_ids + answer_ids)[:engine.config.max_position_embeddings]
        scored = answer_ids[:len(ids) - len(req.prompt_ids)]
        if not scored:
            out[req.id] = (None, 0)
            continue
        cache = engine.new_cache(len(ids))
        logits = engine.to_numpy(run_steps(engine.steps(ids, np.arange(len(ids)), cache)))  # [T, V]
        out[req.id] = (answer_loss(logits[:len(req.prompt_ids) + len(scored)], scored), len(scored))
    return out


@dataclass
class Job:
    """One `llama32 batch` run: where requests come from and go, and how the engines are built."""

    requests: list  # tools.batch_requests.Request, in input order
    done: dict  # id -> record already in the output file
    output: object  # Path
    ckpt: object  # refimpl Checkpoint, base weights
    adapters: dict  # NAME -> load_lora's list
    backend: str
    device: str | None = None
    dtype: str | None = None
    engine_options: dict = field(default_factory=dict)
    evaluate: bool = False
    engine: object = None  # an engine already started (a tensor-parallel one), run instead of building one


def _groups(requests) -> dict:
    """Requests by adapter name (None: the base model), in order of first appearance."""
    groups = {}
    for req in requests:
        groups.setdefault(req.adapter, []).append(req)
    return groups


def eval_losses(job: Job) -> dict[str, tuple[float, int]]:
    """answer_losses of every request with an answer, by a single-sequence engine over each adapter's merged
    weights in turn (teacher-forced logits of every position: the batch engine gives only the sampled rows')."""
    from tools.batch_engines import with_adapter
    from tools.engines import engine_for
    losses = {}
    for name, group in _groups(job.requests).items():
        single = engine_for(with_adapter(job.ckpt, job.adapters.get(name)), job.backend, job.device, job.dtype)
        losses.update(answer_losses(single, group, job.ckpt.tokenizer))
        del single
        _free(job.device)
    return losses


def _eval_record(req, record: dict, losses: dict) -> dict:
    from tools.batch_eval import text_metrics
    loss, tokens = losses.get(req.id, (None, 0))
    return {**text_metrics(record["text"], req.answer), "loss": loss, "answer_tokens": tokens}


def _free(device) -> None:
    """Give a dropped engine's GPU memory back before the next one is built."""
    import gc
    gc.collect()
    if device is None or str(device).startswith("cuda"):
        try:
            import torch
        except ImportError:
            return
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_job(job: Job, progress_stream=None) -> dict:
    """Runs every request not yet in the output through one batch engine serving every adapter they name; returns
    the run's summary (eval metrics over every request of the input, resumed ones included, with `evaluate`)."""
    from tools.batch_engines import batch_engine
    pending = [r for r in job.requests if r.id not in job.done]
    tally, metrics = Tally(), {}
    losses = eval_losses(job) if job.evaluate else {}  # before the batch engine takes its share of the device
    if job.evaluate:
        for req in job.requests:
            if req.id in job.done:
                metrics[req.id] = job.done[req.id].get("eval") or _eval_record(req, job.done[req.id], losses)
    with open(job.output, "a", encoding="utf-8") as f, \
            Progress("batch", len(pending), stream=progress_stream, delay_s=0.5) as progress:
        writer = OrderedWriter(f, [r.id for r in pending])

        def on_done(req, record):
            if job.evaluate:
                record["eval"] = metrics[req.id] = _eval_record(req, record, losses)
            writer.put(req.id, record)

        if pending:
            named = {r.adapter for r in pending}
            adapters = {n: a for n, a in job.adapters.items() if n in named}
            engine = job.engine or batch_engine(job.ckpt, job.backend, job.device, job.dtype, adapters,
                                                **job.engine_options)
            run_group(engine, pending, job.ckpt.tokenizer, job.ckpt.stop_ids, on_done, tally, progress)
            del engine
            _free(job.device)
    elapsed = time.perf_counter() - tally.start
    summary = {"output": str(job.output), "requests": len(job.requests), "resumed": len(job.done),
               "completed": tally.requests, "prompt_tokens": tally.prompt_tokens,
               "completion_tokens": tally.completion_tokens, "elapsed_s": elapsed,
               "output_tokens_per_s": tally.completion_tokens / elapsed if elapsed > 0 else None}
    if job.evaluate:
        from tools.batch_eval import summarize
        summary["eval"] = summarize([metrics[r.id] for r in job.requests if r.id in metrics])
    return summary
