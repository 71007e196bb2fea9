"""BatchEngine: many requests at once over one paged KV cache (continuous batching), the API the CLI and server share.

    eng = BatchEngine.from_checkpoint(ckpt)
    rid = eng.add_request(prompt_ids, SamplingParams(max_tokens=64))
    while eng.has_unfinished():
        for out in eng.step(): ...   # incremental tokens per request

Each step: the scheduler picks the sequences and their token counts (scheduler.py), the runner runs them through the
model as one flat batch (runner.py), the sampler draws each sampled row's token with its request's parameters
(sampler.py), and finished requests give their blocks back.

Overlap (on CUDA): step() launches step n+1 before it reads step n's tokens back, so the host's work for a step
(scheduling, inputs, sampling parameters, outputs) runs while the device computes the one before. A drawn token
stays on the device: its sequence holds a placeholder (Sequence.pending) and the next step's input id is copied
there from the previous step's token tensor (StepInputs.feed); every host -> device copy comes from pinned memory
without waiting (host_copy.py). Step n's tokens reach the host in one copy with an event, read after step n+1 is
launched; step() returns step n's outputs then. What the host learns a step late: a stop token (eos or a stop id).
The sequence already ran in step n+1: that token is dropped, its blocks freed. The step of a request's last token by
max_tokens is known in advance: it is not scheduled again. Penalties count a token still on the device there
(sampler.penalize_rows), and the sampler's draw index counts it too, so the tokens are those of steps read back in
turn (tests/test_batch_step.py, tests/test_batch_gpu.py). On CPU the host runs the model itself: nothing to hide,
each step is read back at once (`overlap=False`, the same code with no step in flight). Token ids only:
text, stop strings and chat templates are handled above the engine; a Llama 3.2 Vision checkpoint's requests may
carry their images as the single-request engine takes them (refimpl.vision.inputs.ImageInputs, built by
refimpl.vision.prepare), each request's image keys/values kept beside its paged self-attention K/V (vision.py). The
checkpoint's eos ids stop every request unless it asks `ignore_eos`.
"""
from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass

import torch

from refimpl.batch_api import RequestOutput, SamplingParams
from refimpl.errors import GenerationError
from refimpl.formats.params import Checkpoint
from refimpl.generate_vision import check_images
from refimpl.model.config import LlamaConfig

from .. import ops
from ..engine import resolve_device, resolve_dtype
from ..vision.weights import load_vision_weights, self_layer_config
from ..weights import DTYPES, Weights, load_weights
from .block_manager import BlockManager
from .memory import IMAGE_KV_SHARE, kv_budget, kv_pool_blocks
from .collectives import ONE_DEVICE
from .runner import ModelRunner
from .sampler import launch_logprobs, logprob_entries, sample
from .scheduler import Scheduled, Scheduler
from .sequence import Sequence, Status
from .vision import VisionLayers, image_kv_bytes, images_key

GPU_BLOCK_SIZE = 64  # tokens a KV block on CUDA: one tile of the paged decode kernel (docs/performance.md)
CPU_BLOCK_SIZE = 16  # elsewhere: the torch path pads every table to whole blocks


def default_block_size(device: torch.device) -> int:
    """The KV pool's block size where the caller names none: on CUDA one tile of the paged decode kernel
    (accel/kernels/paged_attn.py GPU_CONFIG's 64 keys: a tile's keys are then one block's consecutive slots)."""
    return GPU_BLOCK_SIZE if device.type == "cuda" else CPU_BLOCK_SIZE


@dataclass
class _Launched:
    """A step on its way: what reading it back needs."""

    batch: list[Scheduled]
    sampled: list[Scheduled]  # the rows that draw a token, in order
    index: list[int]  # each drawn token's index in its sequence's token_ids (a placeholder until read back)
    last: list[Sequence]  # the sequences whose drawn token is their last (max_tokens)
    tokens: torch.Tensor | None  # [R] on the device
    host: torch.Tensor | None  # [2, R]: the tokens and a finite-logits flag per row, on their way to the host
    ready: torch.cuda.Event | None  # recorded after the copies (None on CPU)
    logprobs: tuple | None  # sampler.launch_logprobs'
    logits: dict | None = None  # with record_logits: request id -> the [V] logits its token was drawn from


class BatchEngine:
    def __init__(self, config: LlamaConfig, weights: Weights, device: torch.device, dtype: str, stop_ids=(),
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, gpu_memory=0.9,
                 block_size: int | None = None, num_blocks: int | None = None, use_triton: bool | None = None,
                 cuda_graphs: bool | None = None, batch_invariant: bool = False, vision=None,
                 overlap: bool | None = None, image_memory: int | None = None, tp=ONE_DEVICE):
        """num_blocks: the pool's size, overriding gpu_memory (tests force a tiny pool); use_triton: the Triton
        kernels (default on CUDA only: on CPU the torch ops are far faster than the interpreter); cuda_graphs:
        decode-only steps replay CUDA graphs (default: on CUDA; never for a step with image rows);
        batch_invariant: each request's tokens and logits the same bits whatever else shares its steps
        (accel/batch/runner.py; slower); vision: (MllamaConfig, VisionWeights) of a Llama 3.2 Vision checkpoint,
        config and weights then being its self-attention layers' (accel.vision.weights.self_layer_config and
        VisionWeights.text); overlap: launch each step before reading the previous one's tokens back (default: on
        CUDA, where the host's work then hides behind the device's; on CPU the host runs the model itself);
        image_memory: a vision model's bytes for its running requests' image keys/values (default IMAGE_KV_SHARE
        of the KV budget, which the pool then does without): requests with images wait while theirs do not fit; tp: rank 0's collectives of a tensor-parallel group
        (accel/tp/batch.py), config and weights then its shard."""
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or value < 1:
                raise GenerationError(f"{name} must be a positive integer, got {value!r}")
        block_size = default_block_size(device) if block_size is None else block_size
        if not isinstance(block_size, int) or block_size < 1:
            raise GenerationError(f"block_size must be a positive integer, got {block_size!r}")
        self.config, self.device, self.dtype_name = config, device, dtype
        self.dtype = DTYPES[dtype]
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        budget = kv_budget(config, device, self.dtype, gpu_memory, max_num_seqs, max_num_batched_tokens)
        image_budget = None
        if vision is not None:  # the images' keys/values live beside the pool: their share comes out of its budget
            image_budget = int(IMAGE_KV_SHARE * budget) if image_memory is None else int(image_memory)
            budget -= image_budget
        if num_blocks is None:
            num_blocks = kv_pool_blocks(config, device, self.dtype, block_size, budget, max_num_seqs, gpu_memory)
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens, image_budget)
        triton = device.type == "cuda" if use_triton is None else use_triton
        if triton and not ops.triton_available(device):
            raise GenerationError(f"use_triton: Triton kernels cannot run on {device} here")
        graphs = device.type == "cuda" and (triton or not batch_invariant) if cuda_graphs is None else cuda_graphs
        if graphs and device.type != "cuda":
            raise GenerationError(f"cuda_graphs: CUDA graphs need a CUDA device, not {device}")
        self.vision_config = None if vision is None else vision[0]
        if vision is not None and batch_invariant:
            raise GenerationError("batch_invariant runs text models only for now (this is a Llama 3.2 Vision model)")
        layers = None if vision is None else VisionLayers(vision[1], vision[0], device, self.dtype)
        self.runner = ModelRunner(config, weights, device, self.dtype, self.blocks, triton, graphs, batch_invariant,
                                  layers, tp)
        self.seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._aborted: list[Sequence] = []
        self._prompt_tokens = self._generation_tokens = 0
        self.overlap = device.type == "cuda" if overlap is None else overlap
        self._in_flight: _Launched | None = None  # the step launched and not read back yet (with overlap)
        self.record_logits = False  # True: each step leaves its sampled rows' logits in last_logits
        self.last_logits: dict[str, torch.Tensor] = {}  # request id -> [V] logits its last token was drawn from

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, device: str | None = None, dtype: str | None = None,
                        max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, gpu_memory=0.9,
                        block_size: int | None = None, batch_invariant: bool = False, quant=None,
                        **options) -> "BatchEngine":
        """ckpt: a refimpl Checkpoint (refimpl.formats.checkpoint.load_checkpoint). Dense weights only. options:
        BatchEngine's num_blocks, use_triton, cuda_graphs."""
        from refimpl.family import family_of
        from refimpl.quant.apply import is_quantized
        if quant is not None or is_quantized(ckpt.params):
            raise GenerationError(f"{ckpt.path}: the batch engine runs dense bf16/fp32 weights only; drop --quant "
                                  f"(or use an unquantized checkpoint)")
        dev = resolve_device(device)
        dtype = resolve_dtype(dtype, dev)
        if family_of(ckpt.config).takes_images:
            vw = load_vision_weights(ckpt.params, ckpt.config, dev, DTYPES[dtype])
            return cls(self_layer_config(ckpt.config), vw.text, dev, dtype, ckpt.stop_ids, max_num_seqs,
                       max_num_batched_tokens, gpu_memory, block_size, batch_invariant=batch_invariant,
                       vision=(ckpt.config, vw), **options)
        weights = load_weights(ckpt.params, ckpt.config, dev, DTYPES[dtype])
        return cls(ckpt.config, weights, dev, dtype, ckpt.stop_ids, max_num_seqs, max_num_batched_tokens, gpu_memory,
                   block_size, batch_invariant=batch_invariant, **options)

    # ---- requests ----
    def add_adapter(self, name: str, adapter: list) -> None:
        """A LoRA adapter requests can name (add_request's `adapter`), applied unmerged, several in one step (the
        stacked adapters and segmented product of accel/lora_stack.py): adapter is refimpl.formats.lora.load_lora's
        list of (param name, A [R, Din], B [Dout, R], scale)."""
        if self.vision_config is not None:
            raise GenerationError(f"adapter {name!r}: the batch engine applies LoRA adapters to text models only "
                                  f"for now (this is a Llama 3.2 Vision model)")
        self.runner.add_adapter(str(name), adapter)

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, adapter: str | None = None, images=None) -> str:
        """adapter: the name of a LoRA adapter given to add_adapter, None: the base model; images: a vision
        model's request's ImageInputs (refimpl.vision.inputs; one image per <|image|> token of the prompt, its
        cross-attention mask one row per prompt token), None: a text request."""
        params = SamplingParams() if params is None else params
        rid = self._fresh_id() if request_id is None else str(request_id)
        if rid in self.seqs:
            raise GenerationError(f"request {rid!r}: a request with this id is already in the engine")
        if adapter is not None and adapter not in self.runner.adapters:
            raise GenerationError(f"request {rid!r}: no adapter named {adapter!r} is loaded (add_adapter first)")
        prompt = self._check_prompt(rid, prompt_ids, params)
        self._check_images(rid, prompt, images)
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.stop_ids)
        seed = secrets.randbits(63) if params.seed is None else params.seed
        seq = Sequence(rid, prompt, params, seed, stop, next(self._arrivals), adapter, images,
                       None if images is None else images_key(images))
        if images is not None:
            seq.image_bytes = image_kv_bytes(self.vision_config, images, len(prompt), self.dtype)
            if seq.image_bytes > self.scheduler.image_budget:
                raise GenerationError(f"request {rid!r}: its images' cross-attention keys/values need "
                                      f"{seq.image_bytes} bytes but the engine keeps {self.scheduler.image_budget} "
                                      f"for them; send fewer images or raise gpu_memory")
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        self._prompt_tokens += len(prompt)
        return rid

    def _fresh_id(self) -> str:
        """"0", "1", ... in order, skipping ids the caller gave to requests still in the engine."""
        while True:
            rid = str(next(self._ids))
            if rid not in self.seqs:
                return rid

    def _check_prompt(self, rid: str, prompt_ids, params: SamplingParams) -> list[int]:
        cfg = self.config
        try:
            prompt = [int(t) for t in prompt_ids]
        except (TypeError, ValueError):
            raise GenerationError(f"request {rid!r}: prompt_ids must be a list of token ids") from None
        if not prompt:
            raise GenerationError(f"request {rid!r}: the prompt is empty")
        rows = cfg.vocab_size if self.vision_config is None else cfg.embedding_rows  # the image token's row too
        bad = next((t for t in prompt if not 0 <= t < rows), None)
        if bad is not None:
            raise GenerationError(f"request {rid!r}: token id {bad} is outside the vocabulary [0, {rows})")
        need = len(prompt) + params.max_tokens - 1  # the last token is sampled, never run through the model
        if need > cfg.max_position_embeddings:
            raise GenerationError(f"request {rid!r}: {len(prompt)} prompt tokens + max_tokens {params.max_tokens} "
                                  f"exceed the model's context of {cfg.max_position_embeddings}")
        if self.blocks.blocks_for(need) > len(self.blocks.blocks):
            raise GenerationError(f"request {rid!r}: {need} tokens need {self.blocks.blocks_for(need)} KV blocks but "
                                  f"the pool holds {len(self.blocks.blocks)}; lower max_tokens or raise gpu_memory")
        return prompt

    def _check_images(self, rid: str, prompt: list[int], images) -> None:
        if self.vision_config is None:
            if images is not None:
                raise GenerationError(f"request {rid!r}: images need a Llama 3.2 Vision model; this one reads text")
            return
        try:
            check_images(prompt, self.vision_config.image_token_index, images)
        except GenerationError as e:
            raise GenerationError(f"request {rid!r}: {e}") from None

    def abort(self, request_id: str) -> None:
        """The request stops now; its output (the tokens it had, a token still on its way included) comes with the
        next step's. A request already at its last token finishes as it would have."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.finish_reason is not None or seq.status is Status.FINISHED:
            return
        seq.finish_reason = "abort"
        self.scheduler.finish(seq)
        self._aborted.append(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- stepping ----
    def step(self) -> list[RequestOutput]:
        """One scheduler step -> an output for every request a step ran (its new tokens; none for a prefill chunk
        that did not reach the prompt's end) and every request aborted since the last step. With `overlap` the
        outputs are those of the step launched by the previous call: this call launches the next step first."""
        launched = self._launch()
        done = self._in_flight if self.overlap else launched
        self._in_flight = launched if self.overlap else None
        if done is not None:
            self._read_back(done)
        if self.record_logits:
            self.last_logits = {} if done is None or done.logits is None else done.logits
        if launched is not None:  # its computed tokens are all known now: full blocks are registered
            self.blocks.commit_all([s.seq for s in launched.batch])
        outputs = self._outputs(done) if done is not None else []
        outputs += [self._finish_output(seq) for seq in self._aborted]
        self._aborted = []
        if launched is not None:  # requests at their max_tokens leave the running queue: nothing more to compute
            for seq in launched.last:
                if seq.status is not Status.FINISHED:
                    self.scheduler.finish(seq)
        return outputs

    def _launch(self) -> "_Launched | None":
        """Schedules and launches a step (its model run, its draws, their copy to the host) -> what reading it back
        needs; None if nothing is scheduled. Nothing here waits for the device: tokens drawn by the step in flight
        reach this step's input ids on the device."""
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished() and self._in_flight is None:
                raise RuntimeError("scheduler made no progress with requests waiting (a bug: add_request checks "
                                   "that each request fits the pool alone)")
            return None
        prev = None if self._in_flight is None else self._in_flight.tokens
        inp = self.runner.prepare(batch)
        logits, head = self.runner.run(inp, prev)
        sampled = inp.sampled
        seqs = [s.seq for s in sampled]
        out = _Launched(batch, sampled, [], [], None, None, None, None)
        if sampled:
            if any(s.penalized for s in seqs):  # the next step reads these tokens after its replay (penalize_rows):
                head = head.clone()  # out of the graph's buffer; else read before it (feed), or never
            greedy = head[0]  # head [2, R]: greedy tokens, finite flags
            out.tokens = sample(logits, seqs, prev, greedy)  # [R]: `greedy` itself when every row is plain greedy
            out.logprobs = launch_logprobs(logits, out.tokens, seqs)
            if out.tokens is not greedy:
                head = torch.stack([out.tokens, head[1]])
            out.host = head.to("cpu", non_blocking=True)  # [2, R]: pinned from a GPU
            if out.tokens.is_cuda:
                out.ready = torch.cuda.Event()
                out.ready.record()
            if self.record_logits:
                out.logits = {s.seq.request_id: row for s, row in zip(sampled, logits.clone())}
        for s in batch:
            s.seq.num_computed += s.num_tokens
        for r, seq in enumerate(seqs):
            out.index.append(seq.push_pending(r))
            if seq.num_generated >= seq.params.max_tokens:
                out.last.append(seq)
        return out

    def _read_back(self, done: "_Launched") -> None:
        """Waits for a launched step's tokens and puts them in their sequences (stop tokens and lengths set finish
        reasons); a row of NaN or Inf logits is an error naming its request (bf16 overflow stays in its own row:
        rows never mix). Rows of requests that stopped at an earlier token are dropped."""
        if not done.sampled:
            return
        if done.ready is not None:
            done.ready.synchronize()
        tokens, finite = done.host.tolist()
        bad = None if all(finite) else \
            next((i for i, ok in enumerate(finite) if not ok and done.index[i] < len(done.sampled[i].seq)), None)
        if bad is not None:
            seq = done.sampled[bad].seq
            raise GenerationError(f"request {seq.request_id!r}: the logits of generated token "
                                  f"{done.index[bad] - seq.num_prompt_tokens} hold NaN or Inf (the weights overflow "
                                  f"in {self.dtype_name}?)")
        entries = dict(logprob_entries(done.logprobs))
        for r, (s, index, token) in enumerate(zip(done.sampled, done.index, tokens)):
            seq = s.seq
            if index >= len(seq.token_ids):  # drawn after its stop token
                continue
            seq.resolve(index, token)
            if r in entries:
                seq.logprobs.append(entries[r])
            self._generation_tokens += 1

    def _outputs(self, done: "_Launched") -> list[RequestOutput]:
        outputs = []
        for s in done.batch:
            seq = s.seq
            if seq.finish_reason == "abort" or self.seqs.get(seq.request_id) is not seq:
                continue  # aborted: its output follows; finished: returned already
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                outputs.append(self._finish_output(seq))
            else:
                outputs.append(seq.output())
        return outputs

    def _finish_output(self, seq: Sequence) -> RequestOutput:
        out = seq.output()
        del self.seqs[seq.request_id]
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 adapters: list[str | None] | None = None, images: list | None = None) -> list[RequestOutput]:
        """Run the prompts to completion (with whatever else is in the engine) -> their final outputs, in input
        order; each output's new_token_ids holds all its generated tokens. adapters, images: one per prompt (or
        None)."""
        params = [params] * len(prompts) if not isinstance(params, list) else params
        adapters = [None] * len(prompts) if adapters is None else adapters
        images = [None] * len(prompts) if images is None else images
        if len(params) != len(prompts) or len(adapters) != len(prompts) or len(images) != len(prompts):
            raise GenerationError(f"generate: {len(prompts)} prompts but {len(params)} sampling parameters, "
                                  f"{len(adapters)} adapters and {len(images)} image inputs")
        ids = [self.add_request(p, s, adapter=a, images=im)
               for p, s, a, im in zip(prompts, params, adapters, images)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids) and self.has_unfinished():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [RequestOutput(r, done[r].token_ids, done[r].token_ids, True, done[r].finish_reason,
                              done[r].num_prompt_tokens, done[r].logprobs) for r in ids]

    def stats(self) -> dict:
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "blocks_used": self.blocks.num_used, "blocks_free": self.blocks.num_free,
                "num_preemptions": self.scheduler.num_preemptions, "prompt_tokens": self._prompt_tokens,
                "generation_tokens": self._generation_tokens,
                "prefix_cached_tokens": self.scheduler.prefix_cached_tokens}
