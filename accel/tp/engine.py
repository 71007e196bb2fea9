"""TPEngine: generation over a tensor-parallel group, rank 0 driving, the other ranks following.

Rank 0 holds the engine contract's `generate` (refimpl.generate.RefEngine's): it broadcasts each request (the
prompt ids and the cache size), every rank runs the same forward over its shard (accel.tp.model: the prompt
eager, each token the fused decode step, replayed as a CUDA graph on the GPU), and rank 0 alone samples from
the gathered logits and broadcasts the token with whether to go on. So greedy and sampled
decoding are the same on every rank by construction, whatever their generators. The other ranks sit in `serve`
until rank 0's `close`.

Messages (int64, broadcast from rank 0): a request [op, prompt length, a number], then the prompt ids, then per
token [token, go on]. op GENERATE: into a cache of at least that capacity (the last one kept while requests fit
in it); KEEP: allocate the kept cache of that
capacity (no prompt follows: `new_cache`, for a chat's turns); CONTINUE: into the kept cache from that position;
FORWARD: the ids' forward alone into the kept cache from that position (`logits`: golden check), no token after;
TRACE: the same op by op, every activation gathered on rank 0 (`steps`: diff, accel.tp.trace); STOP: leave `serve`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from refimpl.errors import GenerationError
from refimpl.generate import Sampling, check_prompt, text_only
from refimpl.model import ops as np_ops
from refimpl.model.config import LlamaConfig
from refimpl.quant.schemes import QuantSpec

from .. import ops
from ..engine import Decoder, check_fits
from ..kernels.tuning import DEFAULT
from ..model import RopeTables, decode_step
from ..sampling import make_generator, penalize, sample
from ..weights import DTYPES, Weights
from .group import TPGroup, failed_ranks, sigint_deferred
from .load import check_quant, load_shard, open_text_checkpoint
from .model import RankSplit, ShardCache, forward
from .shard import ShardPlan, element_bytes, shard_elements
from .trace import trace

STOP, GENERATE, KEEP, CONTINUE, FORWARD, TRACE = 0, 1, 2, 3, 4, 5


class RankFailed(GenerationError):
    """Another rank failed; its own error is printed where it happened."""


class ShardSession:
    """A rank's cache and the decode step over it (accel.engine.Decoder: one CUDA graph replay a token on the GPU,
    the all-reduces and the logits' all-gather captured in it; on the CPU the same step uncaptured). image_tokens:
    a vision model's image slots (the step's cross layers run only with them)."""

    def __init__(self, cache, decoder: Decoder, image_tokens: int = 0):
        self.cache, self.decoder, self.capacity, self.image_tokens = cache, decoder, cache.capacity, image_tokens


def together(group: TPGroup, what: str, fn):
    """fn() on every rank; if it raises on any, every rank raises (the failing rank its own error, unless rank 0
    failed too and says it; the others that rank r failed)."""
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001  told to every rank before anyone raises
        error = e
    failed = failed_ranks(error is None, group)
    if failed:
        if error is not None and (group.is_root or 0 not in failed):
            raise error
        raise RankFailed(f"rank {failed[0]} of --tp {group.world} failed to {what} (its error is printed above)")
    return result


class TPEngine:
    backend = "accel"
    tuning = DEFAULT  # the kernels' launch tables (accel.kernels.tuning)

    def __init__(self, group: TPGroup, cfg: LlamaConfig, weights: Weights, dtype: str):
        self.group, self.dtype_name, self.dtype = group, dtype, DTYPES[dtype]
        self.plan = ShardPlan(cfg, group.rank, group.world)
        self.config, self.local, self.weights = cfg, self.plan.local, weights
        self.device = group.device
        self.triton = group.device.type == "cuda"  # on the CPU, the ops' torch versions (not the interpreter)
        self.use_graph = self.triton
        self.kept: ShardSession | None = None  # the cache a chat's turns continue in (`new_cache`)
        self._session: ShardSession | None = None  # the last request's, kept while the next fits in it

    @classmethod
    def load(cls, group: TPGroup, model_dir: Path, dtype: str | None, quant: QuantSpec | None = None) -> "TPEngine":
        """Every rank loads its shard (quant: each rank quantizes its own slices, accel.tp.load.ShardReader). If
        any fails, every rank raises: rank 0 its own error, or that rank r failed (RankFailed: the failing rank
        prints its own error, unless rank 0 failed too and says it)."""
        dtype = dtype or ("bf16" if group.device.type == "cuda" else "fp32")

        def load():
            if dtype not in DTYPES:
                raise GenerationError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
            check_quant(quant)
            return cls.load_shard(group, Path(model_dir), DTYPES[dtype], quant)
        cfg, weights = together(group, f"load {model_dir}", load)
        return cls(group, cfg, weights, dtype)

    @staticmethod
    def load_shard(group: TPGroup, model_dir: Path, dtype: torch.dtype, quant: QuantSpec | None):
        """(the whole model's config, this rank's weights) of a text checkpoint."""
        cfg = open_text_checkpoint(model_dir, with_tokenizer=False, world=group.world).config
        plan = ShardPlan(cfg, group.rank, group.world)
        check_fits(group.device, shard_elements(plan) * element_bytes(dtype, quant),
                   f"rank {group.rank}'s shard of {model_dir}")
        return cfg, load_shard(model_dir, plan, group.device, dtype, quant)

    # ---- every rank ----
    def alloc_cache(self, capacity: int, image_tokens: int = 0) -> ShardSession:
        """This rank's cache of `capacity` slots (its KV heads), with the RoPE tables, and the decode step over it
        (captured now, before anything is written to the cache: the capture's warm-up runs write slot 0).
        image_tokens: a vision model's (TPVisionEngine), 0 for a text one."""
        assert not image_tokens, "a text model has no image slots"
        c = self.local
        shape = (c.num_hidden_layers, c.num_key_value_heads, capacity, c.head_dim)  # [L, K/N, S, E]
        cos, sin = np_ops.rope_tables(np.arange(capacity), c.head_dim, c.rope_theta, c.rope_scaling)
        cache = ShardCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.from_numpy(cos).to(self.device), torch.from_numpy(sin).to(self.device),
                           torch.arange(capacity, device=self.device))
        return ShardSession(cache, self._decoder(cache))

    def rank_split(self) -> RankSplit:
        """The decode step's collectives on this rank (its embedding rows' first token id, the logits gathered)."""
        return RankSplit(self.group.rank, self.group.world, self.plan.vocab_range()[0], self.config.vocab_size)

    def decode_fn(self, cache):
        """step(token, position) -> the gathered logits [1, V]: accel.model.decode_step over this rank's shard,
        its collectives RankSplit's."""
        split, w, cfg, tuning = self.rank_split(), self.weights, self.local, self.tuning
        tables = RopeTables(cache.cos, cache.sin)

        def step(token, position):
            return decode_step(w, cfg, token, position, tables, cache.k, cache.v, tuning, split)
        return step

    def _decoder(self, cache) -> Decoder:
        """The decode step (decode_fn) over the cache, captured with the thread-local error mode: the NCCL
        watchdog thread polls events meanwhile."""
        return Decoder(self, cache, self.use_graph, self.decode_fn(cache), capture_mode="thread_local")

    def session(self, capacity: int, image_tokens: int = 0) -> ShardSession:
        """A session of at least `capacity` slots (and exactly `image_tokens` image slots): the last one while
        requests fit in it (every rank decides alike: they all see the same requests)."""
        s = self._session
        if s is None or s.capacity < capacity or s.image_tokens != image_tokens:
            self._session = None  # free the old cache and graph before allocating the new ones
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._session = self.alloc_cache(capacity, image_tokens)
        return self._session

    def forward(self, ids: torch.Tensor, start: int, sess: ShardSession) -> torch.Tensor:
        """ids [T] at positions start.. into the session's cache -> the gathered logits [1, V] (one token: the
        decode step's output buffer, rewritten by the next step)."""
        if ids.shape[0] == 1:
            return sess.decoder.step(ids, start)
        return self.prefill(ids, start, sess)

    def prefill(self, ids: torch.Tensor, start: int, sess: ShardSession) -> torch.Tensor:
        """The eager forward (accel.tp.model.forward) of ids [T] at positions start.. -> the gathered logits
        [1, V] of the last one."""
        first_id, _ = self.plan.vocab_range()
        with ops.torch_only(not self.triton):
            return forward(self.weights, self.local, self.config.vocab_size, first_id, self.group.world, ids, start,
                           sess.cache)

    def decode_greedy(self, sess: ShardSession, logits: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """Every rank: n greedy tokens after the prompt's logits, picked on each rank from the same gathered
        logits, so no token is broadcast (accel.engine.Decoder.greedy: no host sync) -> [n] on the device."""
        return sess.decoder.greedy(logits, start, n)

    def _broadcast(self, values: list[int] | None, n: int) -> torch.Tensor:
        t = torch.zeros(n, dtype=torch.int64, device=self.device)
        if values is not None:
            t.copy_(torch.as_tensor(values, dtype=torch.int64))
        dist.broadcast(t, src=0)
        return t

    def _follow(self, ids: torch.Tensor, cache: ShardSession, pos: int) -> None:
        """A worker's request: prefill ids at pos, then decode each token rank 0 broadcasts while it says go on."""
        while True:
            self.forward(ids, pos, cache)
            pos += ids.shape[0]
            token, go = self._broadcast(None, 2).tolist()
            if not go:
                return
            ids = torch.tensor([token], dtype=torch.int64, device=self.device)

    # ---- ranks 1..N-1 ----
    def serve(self) -> None:
        """Follow rank 0's requests until it sends STOP."""
        while True:
            op, n, number = self._broadcast(None, 3).tolist()
            if op == STOP:
                self._session = self.kept = None  # their graphs freed before the group ends (group.end_group)
                return
            self.follow_request(op, n, number)

    def follow_request(self, op: int, n: int, number: int) -> None:
        """A worker's side of one request [op, prompt length, number] (a subclass adds its own ops)."""
        if op == KEEP:
            self.kept = self.alloc_cache(number)
        elif op == GENERATE:  # the session first, as on rank 0: its capture's warm-up steps run collectives
            sess = self.session(number)
            self._follow(self._broadcast(None, n), sess, 0)
        elif op == FORWARD:
            self.forward(self._broadcast(None, n), number, self.kept)
        elif op == TRACE:
            self.trace(self._broadcast(None, n), number)
        else:
            assert op == CONTINUE, op
            self._follow(self._broadcast(None, n), self.kept, number)

    # ---- rank 0 ----
    def close(self) -> None:
        """Release the other ranks from `serve`; free this rank's caches and their CUDA graphs (the group's end waits
        for them: accel.tp.group.end_group)."""
        self._broadcast([STOP, 0, 0], 3)
        self._session = self.kept = None

    def new_cache(self, capacity: int) -> ShardSession:
        """The engine contract's cache (a chat's): every rank allocates its part, kept for `generate(cache=...)`."""
        if not 0 < capacity <= self.config.max_position_embeddings:
            raise GenerationError(f"cache capacity {capacity} is outside [1, {self.config.max_position_embeddings}] "
                                  f"(the model's max_position_embeddings)")
        self._broadcast([KEEP, 0, capacity], 3)
        self.kept = self.alloc_cache(capacity)
        return self.kept

    def logits(self, ids: list[int], start: int) -> torch.Tensor:
        """The gathered logits [1, V] of the last of ids, run at positions start.. into the kept cache (new_cache's)
        by every rank: a prompt's eager forward, one token's decode step (golden check's steps)."""
        if self.kept is None or start + len(ids) > self.kept.capacity:
            raise GenerationError(f"{len(ids)} tokens at position {start} need a cache from new_cache that holds "
                                  f"them")
        self._broadcast([FORWARD, len(ids), start], 3)
        return self.forward(self._broadcast(ids, len(ids)), start, self.kept)

    def trace(self, ids: torch.Tensor, start: int) -> list:
        """Every rank: ids' forward op by op into the kept cache -> [(name, whole activation)] (accel.tp.trace)."""
        with ops.torch_only(not self.triton):
            return trace(self.plan, self.weights, ids, start, self.kept.cache)

    def steps(self, ids, positions, cache: ShardSession, last_logits_only: bool = False, **inputs):
        """The engine protocol's trace mode (refimpl.engine_protocol) over the group, into new_cache's cache:
        every rank runs the forward to its end first (the collectives), then rank 0 yields its activations, so a
        consumer may stop early."""
        text_only(inputs)
        ids, start = [int(i) for i in ids], int(positions[0])
        if cache is not self.kept or list(positions) != list(range(start, start + len(ids))) \
                or start + len(ids) > cache.capacity:
            raise GenerationError("a tensor-parallel trace runs consecutive positions in the cache new_cache made "
                                  "last")
        self._broadcast([TRACE, len(ids), start], 3)
        activations = self.trace(self._broadcast(ids, len(ids)), start)
        if last_logits_only:
            activations[-1] = ("logits", activations[-1][1][-1:])
        yield from activations

    @staticmethod
    def to_numpy(value) -> np.ndarray:
        return value.detach().to(torch.float32).cpu().numpy()

    def generate(self, prompt_ids: list[int], s: Sampling, stop_ids=(), cache: ShardSession | None = None,
                 start: int = 0, **inputs) -> Iterator[int]:
        """refimpl.generate.RefEngine.generate's contract: with `cache` (from new_cache, the last one made), the
        prompt goes at positions start.. after the earlier tokens already in it."""
        text_only(inputs)
        cfg = self.config
        if cache is not None and cache is not self.kept:
            raise GenerationError("a tensor-parallel engine continues in the cache new_cache made last only")
        context = cfg.max_position_embeddings if cache is None else cache.capacity
        check_prompt(prompt_ids, cfg.vocab_size, s.max_new_tokens, context, start)
        if s.max_new_tokens < 1:
            return
        if cache is None:
            start = 0
            capacity = len(prompt_ids) + s.max_new_tokens
            self._broadcast([GENERATE, len(prompt_ids), capacity], 3)
            cache = self.session(capacity)
        else:
            self._broadcast([CONTINUE, len(prompt_ids), start], 3)
        ids = self._broadcast(prompt_ids, len(prompt_ids))
        yield from self._lead(ids, cache, start, s, set(stop_ids))

    def _lead(self, ids: torch.Tensor, cache: ShardSession, pos: int, s: Sampling, stop_ids: set) -> Iterator[int]:
        """Rank 0's side of `_follow`: sample a token and yield it; when asked for the next, tell the others whether
        to go on, then step. A consumer that stops early (the generator closed at its yield) still releases them,
        and Ctrl-C inside a step takes effect after it (accel.tp.group.sigint_deferred): the ranks stay in step."""
        gen = make_generator(self.device, s.seed)
        seen = torch.zeros(self.config.vocab_size, dtype=torch.bool, device=self.device)  # [V]
        seen[ids[ids < self.config.vocab_size]] = True  # not an image token (a vision model's id V)
        told, token = True, None
        try:
            for n in range(s.max_new_tokens):
                with sigint_deferred():
                    if token is not None:
                        go = token not in stop_ids
                        self._broadcast([token, int(go)], 2)
                        told = True
                        if not go:
                            return
                        ids = torch.tensor([token], dtype=torch.int64, device=self.device)
                    logits = self.forward(ids, pos, cache)  # [1, V], gathered
                    pos += ids.shape[0]
                    told = False
                    token = self._next(logits, s, gen, seen, pos)
                yield token
        finally:
            if not told:
                self._broadcast([token or 0, 0], 2)

    def _next(self, logits: torch.Tensor, s: Sampling, gen, seen: torch.Tensor, pos: int) -> int:
        if s.repetition_penalty != 1:
            logits = penalize(logits, seen, s.repetition_penalty)
        if not bool(torch.isfinite(logits).all()):
            raise GenerationError(f"NaN or Inf in the logits at position {pos - 1}; generation stopped")
        token = int(sample(logits, s, gen)[0])
        seen[token] = True
        return token
