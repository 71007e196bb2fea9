"""AccelEngine: the torch + Triton engine, with the same contract as refimpl.generate.RefEngine.

Two ways through the model:
    fast   accel.model.prefill / decode_step over fused weights; the decode step replays one CUDA graph per token
           (captured after a warm-up, so Triton's compilation and autotuning happen outside the capture);
    trace  `steps()`: refimpl.model.llama.forward_steps over accel.ops and HF-named views of the same weights, yielding
           every activation by the one name scheme. The fast path never yields, so tracing costs nothing when off.
Sampling stays on the device (accel.sampling); generate() reads each token back together with a finite-logits
flag in one small copy, issued before the next step is queued, so the host never idles the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from refimpl.model import ops as np_ops
from refimpl.formats.params import Checkpoint
from refimpl.model.config import LlamaConfig
from refimpl.errors import GenerationError
from refimpl.generate import Sampling, check_prompt, nonfinite_error, text_only
from refimpl.model.llama import KVCache, forward_steps

from . import model as fast
from . import ops
from .kernels.tuning import DEFAULT, Tuning
from .sampling import make_generator, penalize, sample
from .weights import DTYPES, Weights, load_weights, params_view


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise GenerationError(f"--device {device!r} is not a device name (expected cpu, cuda or cuda:N)") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise GenerationError(f"--device {device!r}: the accel backend runs on cpu or cuda[:N] only")
    if not torch.cuda.is_available():
        raise GenerationError(f"--device {device!r}: CUDA is not available here (torch {torch.__version__}); "
                              f"use --device cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise GenerationError(f"--device {device!r}: there is no such GPU (this machine has {count})")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


def resolve_dtype(dtype: str | None, device: torch.device) -> str:
    if dtype is None:
        return "bf16" if device.type == "cuda" else "fp32"
    if dtype not in DTYPES:
        raise GenerationError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return dtype


@dataclass
class StaticKVCache(KVCache):
    """refimpl's per-layer cache lists, as views of two preallocated [L, K, S, E] tensors, plus RoPE tables."""

    k_all: torch.Tensor = None  # [L, K, S, E]
    v_all: torch.Tensor = None
    tables: fast.RopeTables = None  # cos/sin [S, E/2] fp32 for every slot


def cache_bytes(cfg: LlamaConfig, capacity: int, element_size: int) -> int:
    kv = 2 * cfg.num_hidden_layers * cfg.kv_size * capacity * element_size  # k and v, [L, K, S, E] each
    return kv + 2 * capacity * (cfg.head_dim // 2) * 4  # + cos/sin tables, fp32


def working_bytes(cfg: LlamaConfig, tokens: int, element_size: int) -> int:
    """A generous bound on a prefill's live activations: a few [T, D], the [T, (H+2K)E] and [T, 2F] GEMM outputs,
    the [T, F] activation, and fp32 logits/sampling buffers of the vocabulary."""
    per_token = 6 * cfg.hidden_size + 2 * (cfg.q_size + 2 * cfg.kv_size) + 4 * cfg.intermediate_size
    return tokens * per_token * element_size + 8 * cfg.vocab_size * 4


def free_bytes(device: torch.device) -> int | None:
    """Device memory a new allocation can use (driver-free plus torch's cached free blocks); None on CPU."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_fits(device: torch.device, need: int, what: str) -> None:
    """Refuse before allocating when the device cannot hold `need` bytes."""
    free = free_bytes(device)
    if free is not None and need > free:
        raise GenerationError(f"{what} needs {need / 2**30:.2f} GiB of {device} memory but only "
                              f"{free / 2**30:.2f} GiB is free; ask for fewer tokens (prompt + --max-new-tokens)")


class Decoder:
    """The one-token decode step over one cache: static token/position inputs, replayed as a CUDA graph on GPU.

    Two graphs over the same buffers: `run` (-> logits, for sampling), and, captured on first use, the greedy
    step (`run_greedy`), which also picks the argmax as the next token, appends it to `history` and advances
    the position on the device, so that a greedy loop is one replay a token (accel/kernels/argmax.py).
    """

    def __init__(self, engine: "AccelEngine", cache: StaticKVCache, use_graph: bool, step_fn=None,
                 capture_mode: str = "global"):
        """step_fn(token, position) -> logits [1, V]: the decode step (default: the text model's). capture_mode:
        torch.cuda.graph's capture_error_mode ("thread_local" where another thread may touch CUDA meanwhile, as
        the NCCL watchdog of a tensor-parallel rank does)."""
        dev = engine.device
        self.token = torch.zeros(1, dtype=torch.int64, device=dev)
        self.position = torch.zeros(1, dtype=torch.int64, device=dev)  # slot 0: harmless before the prefill
        self.step_count = torch.zeros(1, dtype=torch.int64, device=dev)  # the greedy step's index into history
        self.history = torch.zeros(cache.capacity + 1, dtype=torch.int64, device=dev)
        # the closures hold what the step reads, not the engine or self: a reference cycle (engine -> session ->
        # decoder -> closure -> engine) kept dropped engines' weights alive until the next gc pass
        w, cfg, tuning, token, position = engine.weights, engine.config, engine.tuning, self.token, self.position
        step, history, torch_only = self.step_count, self.history, not engine.triton

        if step_fn is None:
            def step_fn(token, position):
                return fast.decode_step(w, cfg, token, position, cache.tables, cache.k_all, cache.v_all, tuning)

        def fn():
            with ops.torch_only(torch_only):
                return step_fn(token, position)

        def greedy_fn():  # fn, not self._fn: no cycle
            logits = fn()
            with ops.torch_only(torch_only):
                return ops.greedy_next(logits, token, position, history, step)
        self._fn, self._greedy_fn = fn, greedy_fn
        self.capacity, self.use_graph, self.torch_only = cache.capacity, use_graph, torch_only
        self.capture_mode = capture_mode
        self.graph = self._greedy_graph = None
        if use_graph:
            self.graph, self.logits = self._capture(self._fn, warmups=3)  # logits [1, V]: rewritten by replays

    def _capture(self, fn, warmups: int):
        """Warm-up runs on a side stream (Triton compiles and tunes outside the capture), then the capture."""
        dev = self.token.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                fn()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=self.capture_mode):
            out = fn()
        return graph, out

    def run(self) -> torch.Tensor:
        """Decode self.token at self.position (already set on the device) -> logits [1, V]."""
        if self.graph is None:
            return self._fn()
        self.graph.replay()
        return self.logits

    def run_greedy(self) -> None:
        """Decode self.token at self.position; then token = argmax, history[step_count] = token, step_count += 1,
        position += 1, all on the device."""
        if not self.use_graph:
            self._greedy_fn()
            return
        if self._greedy_graph is None:
            # one warm-up compiles the argmax kernel (the rest ran in __init__). It writes the cache slot at the
            # position it runs at, so it runs at the last slot: a slot is always rewritten by the step at its
            # own position before attention reads it, so only past slots must be left alone.
            saved = [t.clone() for t in (self.token, self.position, self.step_count)]
            self.position.fill_(self.capacity - 1)
            self.step_count.fill_(self.capacity)
            self._greedy_graph, _ = self._capture(self._greedy_fn, warmups=1)
            for t, v in zip((self.token, self.position, self.step_count), saved):
                t.copy_(v)
        self._greedy_graph.replay()

    def step(self, token: torch.Tensor, position: int) -> torch.Tensor:
        self.token.copy_(token)
        self.position.fill_(position)
        return self.run()

    def greedy(self, logits: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """n greedy tokens after a prompt's logits (the prompt at positions 0..start-1), with no host sync (the
        benchmarks' loop: one greedy-graph replay a token) -> [n] on the device."""
        if start + n - 1 > self.capacity:
            raise GenerationError(f"{n} tokens after {start} do not fit the session's {self.capacity} slots")
        self.position.fill_(start - 1)
        self.step_count.zero_()
        # the first token comes from the prompt's logits: token, history[0], position = start
        with ops.torch_only(self.torch_only):
            ops.greedy_next(logits, self.token, self.position, self.history, self.step_count)
        for _ in range(n - 1):
            self.run_greedy()
        return self.history[:n].clone()


@dataclass
class DecodeSession:
    """A cache and the decoder captured over it, kept for the next request that fits in it."""

    cache: StaticKVCache
    decoder: Decoder
    capacity: int = field(init=False)

    def __post_init__(self):
        self.capacity = self.cache.capacity


class AccelEngine:
    backend = "accel"

    def __init__(self, config: LlamaConfig, weights: Weights, device: torch.device, dtype: str,
                 use_graph: bool | None = None, use_triton: bool | None = None, tuning: Tuning = DEFAULT):
        """use_triton False: every op's torch version (accel.ops.torch_only), a baseline; tuning: the kernels'
        launch tables (accel.kernels.tuning), for benchmarks that try others."""
        self.config, self.weights, self.device, self.dtype_name = config, weights, device, dtype
        self.dtype = DTYPES[dtype]
        self.use_graph = device.type == "cuda" if use_graph is None else use_graph
        self.triton = ops.triton_available(device) if use_triton is None else use_triton
        self.tuning = tuning
        self.params = self.trace_params()
        self._session: DecodeSession | None = None

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, device: str | None = None, dtype: str | None = None,
                        quant=None, **options) -> "AccelEngine":
        """quant: a refimpl.quant.schemes.QuantSpec (int8/int4: quantized on the device, bit for bit the refimpl's
        quantization); a checkpoint already holding quantized records (refimpl.quant) runs them as they are."""
        dev = resolve_device(device)
        dtype = resolve_dtype(dtype, dev)
        cfg = ckpt.config
        size = sum(getattr(a, "size", 0) or a.nbytes for a in ckpt.params.values()) * DTYPES[dtype].itemsize
        check_fits(dev, size, f"the weights of {ckpt.path} in {dtype}")
        return cls(cfg, load_weights(ckpt.params, cfg, dev, DTYPES[dtype], quant), dev, dtype, **options)

    def trace_params(self) -> dict:
        """Trace mode's parameters: HF names, views of the fused tensors."""
        return params_view(self.weights, self.config)

    # ---- the engine contract ----
    def new_cache(self, capacity: int) -> StaticKVCache:
        cfg = self.config
        if not 0 < capacity <= cfg.max_position_embeddings:
            raise GenerationError(f"cache capacity {capacity} is outside [1, {cfg.max_position_embeddings}] "
                                  f"(the model's max_position_embeddings)")
        size = self.dtype.itemsize
        check_fits(self.device, cache_bytes(cfg, capacity, size) + working_bytes(cfg, capacity, size),
                   f"a KV cache of {capacity} positions ({cache_bytes(cfg, capacity, size) / 2**30:.2f} GiB) "
                   f"plus working memory")
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, capacity, cfg.head_dim)  # [L, K, S, E]
        k_all = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v_all = torch.zeros(shape, dtype=self.dtype, device=self.device)
        cos, sin = np_ops.rope_tables(np.arange(capacity), cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        tables = fast.RopeTables(torch.from_numpy(cos).to(self.device), torch.from_numpy(sin).to(self.device))
        return StaticKVCache(list(k_all.unbind(0)), list(v_all.unbind(0)), k_all, v_all, tables)

    def to_numpy(self, value) -> np.ndarray:
        return value.detach().to(torch.float32).cpu().numpy()

    def from_numpy(self, array: np.ndarray, like=None) -> torch.Tensor:
        dtype, device = (like.dtype, like.device) if like is not None else (self.dtype, self.device)
        return torch.from_numpy(np.ascontiguousarray(array, np.float32)).to(device=device, dtype=dtype)

    def steps(self, ids, positions, cache: KVCache, last_logits_only: bool = False, **inputs):
        """Trace mode: the op-by-op forward over accel.ops, yielding (name, torch tensor)."""
        text_only(inputs)
        ids = torch.as_tensor(np.asarray(ids, np.int64), device=self.device)
        positions = torch.as_tensor(np.asarray(positions, np.int64), device=self.device)
        return forward_steps(ops, self.params, self.config, ids, positions, cache, last_logits_only)

    # ---- the fast path ----
    def release(self) -> None:
        """Frees the held decode session (its cache and captured graph); the next request builds a new one."""
        self._session = None

    def session(self, capacity: int) -> DecodeSession:
        """A cache of at least `capacity` slots with its captured decoder; reused while requests fit in it."""
        if self._session is None or self._session.capacity < capacity:
            self._session = None  # free the old cache and graph before allocating the new ones
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            cache = self.new_cache(capacity)
            self._session = DecodeSession(cache, Decoder(self, cache, self.use_graph))
        return self._session

    def prefill(self, prompt_ids, sess: DecodeSession, start: int = 0) -> torch.Tensor:
        """The prompt (a list, or an int64 tensor already on the device) at positions start..start+P-1 into the
        session's cache -> next-token logits [1, V] (eager)."""
        c = sess.cache
        if start + len(prompt_ids) > c.capacity:
            raise GenerationError(f"{len(prompt_ids)} tokens after {start} do not fit the session's {c.capacity} "
                                  "slots")
        ids = torch.as_tensor(prompt_ids, dtype=torch.int64, device=self.device)
        with ops.torch_only(not self.triton):
            return fast.prefill(self.weights, self.config, ids, c.tables, c.k_all, c.v_all, start)

    def _session_over(self, cache: StaticKVCache) -> DecodeSession:
        """The session whose cache is `cache` (a chat keeps one across turns), its decoder captured once."""
        if self._session is None or self._session.cache is not cache:
            self._session = DecodeSession(cache, Decoder(self, cache, self.use_graph))
        return self._session

    def decode_greedy(self, sess: DecodeSession, logits: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """n greedy tokens after the prompt's logits (Decoder.greedy) -> [n] on the device."""
        return sess.decoder.greedy(logits, start, n)

    def generate(self, prompt_ids: list[int], s: Sampling, stop_ids=(), cache: StaticKVCache | None = None,
                 start: int = 0, **inputs) -> Iterator[int]:
        """refimpl.generate.RefEngine.generate's contract: with `cache` (from new_cache), the prompt goes at
        positions start.. after the earlier tokens already in it."""
        text_only(inputs)
        cfg = self.config
        context = cfg.max_position_embeddings if cache is None else cache.capacity
        check_prompt(prompt_ids, cfg.vocab_size, s.max_new_tokens, context, start)
        sess = self.session(len(prompt_ids) + s.max_new_tokens) if cache is None else self._session_over(cache)
        yield from self._sample_loop(sess, self.prefill(prompt_ids, sess, start), prompt_ids, s, stop_ids, start)

    def _sample_loop(self, sess: DecodeSession, logits: torch.Tensor, prompt_ids: list[int], s: Sampling,
                     stop_ids, start: int = 0) -> Iterator[int]:
        """Sample from the prompt's logits, then one decode step a token, until a stop id or max_new_tokens."""
        gen = make_generator(self.device, s.seed)
        cuda = self.device.type == "cuda"
        host = torch.empty(2, dtype=torch.int64, pin_memory=cuda)  # (token, logits all finite)
        ready = torch.cuda.Event() if cuda else None
        step_ids, pos = list(prompt_ids), start + len(prompt_ids)
        seen = None
        if s.repetition_penalty != 1:
            V = self.config.vocab_size
            seen = torch.zeros(V, dtype=torch.bool, device=self.device)  # [V]
            seen[torch.as_tensor([t for t in prompt_ids if t < V], dtype=torch.int64, device=self.device)] = True
        for n in range(s.max_new_tokens):
            if seen is not None:
                logits = penalize(logits, seen, s.repetition_penalty)
            token = sample(logits, s, gen)  # [1] on the device
            if seen is not None:
                seen[token] = True
            host.copy_(torch.stack([token[0], torch.isfinite(logits).all().to(torch.int64)]), non_blocking=cuda)
            if cuda:
                ready.record()
            if n + 1 < s.max_new_tokens:  # queue the next step before waiting for this token
                logits = sess.decoder.step(token, pos)
            if cuda:
                ready.synchronize()
            value, finite = host.tolist()
            if not finite:
                self._raise_nonfinite(step_ids, pos - len(step_ids), sess.cache)
            yield value
            if value in stop_ids:
                return
            step_ids, pos = [value], pos + 1

    def _raise_nonfinite(self, ids: list[int], start: int, cache: KVCache):
        """Rerun the failed step through trace mode and name the first activation holding NaN or Inf."""
        positions = np.arange(start, start + len(ids))
        raise nonfinite_error(self.steps(ids, positions, cache, last_logits_only=True), start,
                              all_finite=lambda value: bool(torch.isfinite(value).all()))
