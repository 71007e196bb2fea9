"""BatchEngine: many requests at once over one paged KV cache (continuous batching), the API the CLI and server share.

    eng = BatchEngine.from_checkpoint(ckpt)
    rid = eng.add_request(prompt_ids, SamplingParams(max_tokens=64))
    while eng.has_unfinished():
        for out in eng.step(): ...   # incremental tokens per request

Each step: the scheduler picks the sequences and their token counts (scheduler.py), the runner runs them through the
model as one flat batch (runner.py), the sampler draws each sampled row's token with its request's parameters
(sampler.py), and finished requests give their blocks back. The tokens come back in one non-blocking copy: what needs
no token (computed counts, full blocks registered) is done while the device still runs the step. Token ids only:
text, stop strings and chat templates are handled above the engine; a Llama 3.2 Vision checkpoint's requests may
carry their images as the single-request engine takes them (refimpl.vision.inputs.ImageInputs, built by
refimpl.vision.prepare), each request's image keys/values kept beside its paged self-attention K/V (vision.py). The
checkpoint's eos ids stop every request unless it asks `ignore_eos`.
"""
from __future__ import annotations

import itertools
import secrets

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
from .collectives import ONE_DEVICE
from .runner import ModelRunner
from .sampler import logprob_rows, sample
from .scheduler import Scheduler
from .sequence import Sequence
from .vision import VisionLayers, images_key

DEFAULT_BLOCK_SIZE = 16
CPU_KV_BYTES = 1 << 30  # the KV pool's budget on CPU, where free memory says little about what is wise to take


def kv_pool_blocks(cfg: LlamaConfig, device: torch.device, dtype: torch.dtype, block_size: int, gpu_memory,
                   max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """How many blocks the pool gets. gpu_memory: a FRACTION (0, 1] of the GPU's total memory the engine may hold
    in all (weights already loaded, a working reserve for a step of max_num_batched_tokens, and the pool), or a
    number of BYTES (> 1) for the pool itself; on CPU a fraction means CPU_KV_BYTES. Never more blocks than
    max_num_seqs sequences of the model's whole context could use."""
    per_block = ModelRunner.kv_bytes_per_block(cfg, block_size, dtype)  # the pool holds one spare block more
    if isinstance(gpu_memory, bool) or not isinstance(gpu_memory, (int, float)) or not gpu_memory > 0:
        raise GenerationError(f"gpu_memory must be a fraction in (0, 1] or a number of bytes, got {gpu_memory!r}")
    if gpu_memory > 1:
        budget = int(gpu_memory)
    elif device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        budget = int(gpu_memory * total) - torch.cuda.memory_allocated(device) - working_bytes(
            cfg, max_num_batched_tokens, max_num_seqs, dtype.itemsize)
    else:
        budget = CPU_KV_BYTES
    most = max_num_seqs * -(-cfg.max_position_embeddings // block_size)
    blocks = min(budget // per_block - 1, most)
    if blocks < 1:
        raise GenerationError(f"gpu_memory={gpu_memory!r} leaves no room for the KV cache on {device} (one block of "
                              f"{block_size} tokens needs {per_block} bytes); raise it")
    return blocks


def working_bytes(cfg: LlamaConfig, tokens: int, seqs: int, element_size: int) -> int:
    """A generous bound on a step's live activations: a few [T, D], the [T, (H+2K)E] and [T, 2F] GEMM outputs, the
    [T, F] activation, one prefill chunk's gathered K/V, and fp32 logits and sampling buffers of [seqs, V]."""
    per_token = 6 * cfg.hidden_size + 2 * (cfg.q_size + 2 * cfg.kv_size) + 4 * cfg.intermediate_size
    gathered = 2 * cfg.kv_size * cfg.max_position_embeddings
    return (tokens * per_token + gathered) * element_size + 8 * seqs * cfg.vocab_size * 4


class BatchEngine:
    def __init__(self, config: LlamaConfig, weights: Weights, device: torch.device, dtype: str, stop_ids=(),
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, gpu_memory=0.9,
                 block_size: int | None = None, num_blocks: int | None = None, use_triton: bool | None = None,
                 cuda_graphs: bool | None = None, batch_invariant: bool = False, vision=None, tp=ONE_DEVICE):
        """num_blocks: the pool's size, overriding gpu_memory (tests force a tiny pool); use_triton: the Triton
        kernels (default on CUDA only: on CPU the torch ops are far faster than the interpreter); cuda_graphs:
        decode-only steps replay CUDA graphs (default: on CUDA; never for a step with image rows);
        batch_invariant: each request's tokens and logits the same bits whatever else shares its steps
        (accel/batch/runner.py; slower); vision: (MllamaConfig, VisionWeights) of a Llama 3.2 Vision checkpoint,
        config and weights then being its self-attention layers' (accel.vision.weights.self_layer_config and
        VisionWeights.text); tp: rank 0's collectives of a tensor-parallel group (accel/tp/batch.py), config and
        weights then its shard."""
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or value < 1:
                raise GenerationError(f"{name} must be a positive integer, got {value!r}")
        block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        if not isinstance(block_size, int) or block_size < 1:
            raise GenerationError(f"block_size must be a positive integer, got {block_size!r}")
        self.config, self.device, self.dtype_name = config, device, dtype
        self.dtype = DTYPES[dtype]
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        if num_blocks is None:
            num_blocks = kv_pool_blocks(config, device, self.dtype, block_size, gpu_memory, max_num_seqs,
                                        max_num_batched_tokens)
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens)
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
        seq = self.seqs.get(request_id)
        if seq is None or seq.finish_reason is not None:
            return
        seq.finish_reason = "abort"
        self.scheduler.finish(seq)
        self._aborted.append(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ----
    def step(self) -> list[RequestOutput]:
        """One scheduler step -> an output for every request it ran (its new tokens; none for a prefill chunk that
        did not reach the prompt's end) and every request aborted since the last step."""
        outputs = [self._finish_output(seq) for seq in self._aborted]
        self._aborted = []
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests waiting (a bug: add_request checks "
                                   "that each request fits the pool alone)")
            return outputs
        inp = self.runner.prepare(batch)
        logits = self.runner.run(inp)
        drawn = self._sample(logits, inp.sampled) if inp.sampled else None
        if self.record_logits:
            self.last_logits = {s.seq.request_id: logits[r] for r, s in enumerate(inp.sampled)}
        for s in batch:  # while the device runs the step: its K/V count as computed, full blocks are registered
            s.seq.num_computed += s.num_tokens
            self.blocks.commit(s.seq)
        tokens, logprobs = self._read_back(logits, inp.sampled, *drawn) if drawn else ([], [])
        for r, entry in logprobs:
            inp.sampled[r].seq.logprobs.append(entry)
        for s, token in zip(inp.sampled, tokens):
            s.seq.append(token)
            self._generation_tokens += 1
        for s in batch:
            if s.seq.finish_reason is not None:
                self.scheduler.finish(s.seq)
                outputs.append(self._finish_output(s.seq))
            else:
                outputs.append(s.seq.output())
        return outputs

    def _sample(self, logits: torch.Tensor, sampled) -> tuple:
        """Launches the sampled rows' draws -> (tokens [R] on the device, the tokens and a finite-logits flag per
        row [2, R] on their way to the host, the CUDA event they are there at; None on CPU). Nothing waits here."""
        token_t = sample(logits, [s.seq for s in sampled])  # [R]
        finite = torch.isfinite(logits).all(dim=-1).to(torch.int64)  # [R]
        host = torch.stack([token_t, finite]).to("cpu", non_blocking=True)  # [2, R]: pinned when from the device
        ready = None
        if token_t.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return token_t, host, ready

    def _read_back(self, logits: torch.Tensor, sampled, token_t: torch.Tensor, host: torch.Tensor, ready) -> tuple:
        """Waits for _sample's copy -> (the tokens, the logprobs of the rows that ask for them); a row of NaN or Inf
        logits is an error naming its request (bf16 overflow stays in its own row: rows never mix)."""
        if ready is not None:
            ready.synchronize()
        tokens, finite = host.tolist()
        bad = next((s.seq for s, ok in zip(sampled, finite) if not ok), None)
        if bad is not None:
            raise GenerationError(f"request {bad.request_id!r}: the logits of generated token {bad.num_generated} "
                                  f"hold NaN or Inf (the weights overflow in {self.dtype_name}?)")
        return tokens, logprob_rows(logits, token_t, [s.seq for s in sampled])

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
