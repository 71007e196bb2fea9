"""The model runner: one step's flat token batch through the model over the paged KV cache.

A step's tokens are laid out flat, [T] rows: first the decode rows (sequences fed one token this step), then each
prefill chunk (a new prompt, or the next chunk of a long one, possibly after a cached prefix) in turn. Every layer:
    qkv GEMM over all T rows -> RoPE at each row's position, k/v written to each row's slot (slot mapping);
    attention: the decode rows at once with the paged decode kernel (accel/ops/paged.py) over the block tables;
      each prefill chunk with the causal flash attention over its sequence's K/V gathered from the pool into a
      contiguous [K, n, E] (positions 0..n-1 in order: the chunk's earlier prefix included);
    o, gate_up, down GEMMs over all T rows (one read of the weights for the whole batch), residual adds in the norms.
The GEMMs run cuBLAS, or the weight-streaming kernel (accel/kernels/matmul.py) for the weight shapes and row buckets
where it measured faster (accel/kernels/tuning.py's MATMUL); gate_up with SwiGLU in that kernel's epilogue where
SWIGLU_MATMUL lists the shape and bucket (no [T, 2F] round trip, one launch fewer), else the GEMM then SwiGLU.
LoRA adapters are applied unmerged, per row: the runner holds every adapter stacked (accel/lora_stack.py), a step
builds the tiles of its rows' adapters once, and each linear layer adds every row's update in one segmented product
(accel/ops/lora_batch.py), whatever mix of adapters and base rows shares the step.
A Llama 3.2 Vision model runs its cross-attention layers between the self layers (vision.py): the rows of requests
with images through them, each request's rows attending to its own images.
The lm_head runs only on the rows whose logits give a token (each sequence's last row, when its chunk reaches its
last token).

The gather for prefill chunks copies a sequence's K/V once per layer and chunk (n·K·E elements, small beside the
chunk's GEMMs), and reuses the tested flash attention as it is.

The batch-invariant mode gives each row the same bits whatever shares its step: the linear layers run one tiling for
every row count (accel/kernels/matmul.py), and every row, prefill rows too, attends through the paged kernel with its
own table and length, its splits combined in order (no path or reduction order that depends on the batch, the
chunking or the tables' width); the norms, RoPE and SwiGLU are per-row already.

A step of decode rows only (every sequence fed its one next token) replays a CUDA graph instead (graphs.py): its
inputs padded to a batch-size bucket and a table width, the padding rows writing their k/v to a slot of a spare block
past the pool (`pad_slot`) and attending to nothing.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch

from refimpl.errors import GenerationError
from refimpl.model import ops as np_ops
from refimpl.model.config import LlamaConfig

from .. import ops
from ..lora_stack import LoraStack, stack_adapters
from ..ops.paged import (batched_linear, batched_swiglu_linear, greedy_rows, invariant_linear, invariant_swiglu_linear,
                         paged_decode_attention)
from ..ops.torch_ops import split_qkv
from ..weights import Weights
from .block_manager import BlockManager
from .collectives import ONE_DEVICE
from .graphs import GRAPH_INPUTS, DecodeGraphs, feed_ids
from .host_copy import host_tensor
from .scheduler import Scheduled
from .vision import ImageStep, VisionLayers


@dataclass
class StepInputs:
    ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64: where each row's k/v go in the pool
    num_decode: int  # rows 0..num_decode-1 are decode rows
    tables: torch.Tensor  # [num_decode, W] int32 block tables of the decode rows
    lens: torch.Tensor  # [num_decode] int32: their lengths after this step
    prefills: list[tuple[int, int, torch.Tensor]]  # (first row, rows, slots of positions 0..last) per chunk
    sample_rows: torch.Tensor  # [R] int64: rows whose logits give a token
    sampled: list[Scheduled]  # the sequences of those rows, in order
    graph_key: tuple[int, int] | None = None  # (rows, table width) of the CUDA graph that runs it, padded to those
    lora_tiles: torch.Tensor | None = None  # [NT, 3] int32 (first row, end row, adapter index); None: no adapter
    images: ImageStep | None = None  # vision models: the rows of requests with images (accel/batch/vision.py)
    feed: torch.Tensor | None = None  # [2, F] int64 (row, row of the previous step's tokens): ids[row] = prev[...]


class DecodeTables:
    """The decode rows' block tables as one [n, W] int32 matrix, kept from step to step: while the same sequences
    decode in the same order (most steps), only the rows whose table grew are written (a table only grows while its
    sequence runs: preemption and finishing take it out of the rows)."""

    SLACK = 8  # columns past the widest table: a few steps of growth before the matrix is built again

    def __init__(self):
        self.seqs: list = []
        self.have = np.zeros(0, np.int64)  # [n] blocks of each row's table
        self.tables = np.zeros((0, 0), np.int32)

    def of(self, seqs: list, width: int) -> np.ndarray:
        """-> [len(seqs), >= width] int32, row i seqs[i]'s block table (zeros after it)."""
        n = len(seqs)
        have = np.fromiter(map(len, (q.block_table for q in seqs)), np.int64, n)
        if seqs != self.seqs or width > self.tables.shape[1] or (have < self.have).any():
            self.tables = np.zeros((n, width + self.SLACK), np.int32)
            self.tables[np.arange(self.tables.shape[1]) < have[:, None]] = np.fromiter(
                itertools.chain.from_iterable(q.block_table for q in seqs), np.int32, int(have.sum()))  # row-major
            self.seqs = list(seqs)
        else:
            for i in np.flatnonzero(have != self.have).tolist():
                self.tables[i, self.have[i]:have[i]] = seqs[i].block_table[self.have[i]:]
        self.have = have
        return self.tables


class ModelRunner:
    def __init__(self, cfg: LlamaConfig, weights: Weights, device: torch.device, dtype: torch.dtype,
                 blocks: BlockManager, use_triton: bool, cuda_graphs: bool, invariant: bool = False,
                 vision: VisionLayers | None = None, tp=ONE_DEVICE):
        """invariant: the batch-invariant mode (module docstring); vision: a Llama 3.2 Vision model's cross layers
        (cfg and weights are then its self-attention layers'); tp: the collectives of a tensor-parallel rank
        (accel/batch/collectives.py; cfg and weights then the rank's shard)."""
        self.cfg, self.w, self.device, self.dtype = cfg, weights, device, dtype
        self.tp = tp
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.use_triton = use_triton
        self.invariant = invariant
        self.pad_slot = len(blocks.blocks) * self.block_size  # the first slot of a spare block, past the pool's
        slots = self.pad_slot + self.block_size
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, slots, cfg.head_dim)  # [L, K, S, E]
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        cos, sin = np_ops.rope_tables(np.arange(cfg.max_position_embeddings), cfg.head_dim, cfg.rope_theta,
                                      cfg.rope_scaling)  # [P, E/2] fp32 each
        self.cos, self.sin = torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device)
        self.max_width = blocks.blocks_for(cfg.max_position_embeddings)  # blocks of the longest sequence
        self.graphs = DecodeGraphs(self) if cuda_graphs else None
        self._tables = DecodeTables()
        self.adapters: dict[str, list] = {}  # LoRA adapters by name, as add_adapter took them
        self.vision = vision
        self.lora: LoraStack | None = None  # all of them stacked on the device, in the model's dtype

    def add_adapter(self, name: str, adapter: list) -> None:
        """Stacks every adapter again with this one (a bad adapter is refused before anything changes)."""
        if name in self.adapters:
            raise GenerationError(f"adapter {name!r} is already loaded")
        adapters = {**self.adapters, name: adapter}
        self.lora = stack_adapters(adapters, self.cfg, self.device, self.dtype)
        self.adapters = adapters

    @staticmethod
    def kv_bytes_per_block(cfg: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * block_size * cfg.head_dim * dtype.itemsize

    # ---- inputs ----
    def prepare(self, batch: list[Scheduled]) -> StepInputs:
        """The step's inputs on the host (pinned on CUDA: `placed` and the graphs copy them without waiting for the
        device), built in NumPy over whole columns (torch.tensor over nested lists costs about a microsecond an
        element). A decode row whose token is still on the device (Sequence.pending) gets it there:
        StepInputs.feed."""
        decode, prefill = [], []
        for s in batch:
            (decode if s.num_tokens == 1 else prefill).append(s)
        dseqs = [s.seq for s in decode]
        samples = [q.num_computed + 1 == len(q.token_ids) for q in dseqs]  # a prompt's 1-token chunk: no sample
        adapters = any(s.seq.adapter is not None for s in batch)
        width = max(map(len, (q.block_table for q in dseqs)), default=1)
        graphable = self.graphs and not prefill and all(samples) and not adapters \
            and all(q.images is None for q in dseqs)  # the graphs hold no adapter and no image
        key = self.graphs.key(len(decode), width) if graphable else None
        rows, width = key if key is not None else (len(decode), width)
        T = rows + sum(s.num_tokens for s in prefill)
        ids = np.zeros(T, np.int64)  # padding rows: token 0 at position 0 into the spare slot, length 0
        positions = np.zeros(T, np.int64)
        slots = np.full(T, self.pad_slot, np.int64)
        tables, lens = self._decode_rows(dseqs, rows, width, ids, positions, slots)
        chunks = self._prefill_rows(prefill, rows, ids, positions, slots)
        prefill_samples = [s.samples for s in prefill]
        sampled = [s for s, ok in zip(decode, samples) if ok] + [s for s, ok in zip(prefill, prefill_samples) if ok]
        sample_rows = [i for i, ok in enumerate(samples) if ok] + [f + n - 1 for (f, n, _), ok in
                                                                  zip(chunks, prefill_samples) if ok]
        feed = [(i, q.pending_row) for i, q in enumerate(dseqs) if q.pending]  # (row, its token's row in prev)
        lora_rows = self._adapter_rows(decode, prefill, chunks, T) if adapters else None
        images = self._image_rows(decode, prefill, chunks) if self.vision is not None else None
        num_paged = rows
        if self.invariant and prefill:  # every row through the paged kernel, each with its own table and length
            tables, lens = self._rows_tables(tables, lens, prefill, T)
            num_paged, chunks = T, []
        pin = self.device.type == "cuda" and key is None  # a graphed step's inputs are packed: graphs.py

        def t(x):
            return host_tensor(x, pin=pin)
        return StepInputs(t(ids), t(positions), t(slots), num_paged, t(tables), t(lens),
                          [(f, n, t(sl)) for f, n, sl in chunks], t(np.asarray(sample_rows, np.int64)), sampled, key,
                          t(self.lora.tiles(lora_rows, "cpu")) if adapters else None, images,
                          t(np.asarray(feed, np.int64).T) if feed else None)

    def placed(self, inp: StepInputs) -> StepInputs:
        """prepare's host tensors on the device, each copy queued from pinned memory (nothing waits); a graphed
        step's GRAPH_INPUTS and feed stay on the host (graphs.run sends them into its graph's own buffer in one
        copy), and its sample_rows too (every row of a graph gives logits)."""
        if self.device.type != "cuda":
            return inp
        keep = (*GRAPH_INPUTS, "feed", "sample_rows") if inp.graph_key is not None else ()

        def move(x):
            return x if x is None or x.device.type == "cuda" else x.to(self.device, non_blocking=True)
        moved = {name: move(getattr(inp, name)) for name in ("ids", "positions", "slots", "tables", "lens",
                                                            "sample_rows", "lora_tiles", "feed") if name not in keep}
        return replace(inp, prefills=[(f, n, move(sl)) for f, n, sl in inp.prefills], **moved)

    def _decode_rows(self, dseqs: list, rows: int, width: int, ids, positions, slots):
        """Rows 0.. of the decode sequences: their token (0 where it is still on the device), position and slot ->
        (tables [rows, width], lens [rows])."""
        n, bs = len(dseqs), self.block_size
        tables = np.zeros((rows, width), np.int32)
        lens = np.zeros(rows, np.int32)
        if not n:
            return tables, lens
        pos = np.fromiter((q.num_computed for q in dseqs), np.int64, n)
        ids[:n] = np.maximum(np.fromiter((q.token_ids[q.num_computed] for q in dseqs), np.int64, n), 0)
        positions[:n] = pos
        lens[:n] = pos + 1
        table = self._tables.of(dseqs, width)  # [n, >= width]
        tables[:n] = table[:, :width]
        slots[:n] = table[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        return tables, lens

    def _prefill_rows(self, prefill: list[Scheduled], first: int, ids, positions, slots) -> list:
        """The prefill chunks' rows from `first` on -> [(first row, rows, slots of positions 0..last)] per chunk."""
        chunks = []
        for s in prefill:
            seq, start, n = s.seq, s.seq.num_computed, s.num_tokens
            seq_slots = self._slots(seq.block_table, start + n)  # positions 0..start+n-1
            ids[first:first + n] = seq.token_ids[start:start + n]
            positions[first:first + n] = np.arange(start, start + n)
            slots[first:first + n] = seq_slots[start:]
            chunks.append((first, n, seq_slots))
            first += n
        return chunks

    def _image_rows(self, decode: list[Scheduled], prefill: list[Scheduled], chunks) -> ImageStep | None:
        """The rows of the sequences with images (None: none), each sequence's images encoded at its first
        chunk."""
        out = []
        firsts = list(range(len(decode))) + [f for f, _, _ in chunks]
        for first, s in zip(firsts, decode + prefill):
            seq = s.seq
            if seq.images is None:
                continue
            if seq.image_kv is None:
                with torch.inference_mode(), ops.torch_only(not self.use_triton):
                    seq.image_kv = self.vision.encode(seq.images, seq.num_prompt_tokens)
            out.append(self.vision.rows(seq.image_kv, first, seq.num_computed, s.num_tokens))
        return ImageStep.of(out, self.device)

    @staticmethod
    def _adapter_rows(decode: list[Scheduled], prefill: list[Scheduled], chunks, T: int) -> list[str | None]:
        """Each row's LoRA adapter (None: the base model; padding rows too)."""
        out: list[str | None] = [None] * T
        for i, s in enumerate(decode):
            out[i] = s.seq.adapter
        for (first, n, _), s in zip(chunks, prefill):
            out[first:first + n] = [s.seq.adapter] * n
        return out

    def _rows_tables(self, tables, lens, prefill: list[Scheduled], T: int):
        """The decode rows' tables and lengths extended by one row per prefill token (its sequence's table, its
        position + 1) -> tables [T, W], lens [T]."""
        width = max([tables.shape[1]] + [len(s.seq.block_table) for s in prefill])
        all_tables = np.zeros((T, width), np.int32)
        all_tables[:tables.shape[0], :tables.shape[1]] = tables
        all_lens = np.zeros(T, np.int32)
        all_lens[:len(lens)] = lens
        first = tables.shape[0]
        for s in prefill:
            start, n, table = s.seq.num_computed, s.num_tokens, s.seq.block_table
            all_tables[first:first + n, :len(table)] = table
            all_lens[first:first + n] = np.arange(start + 1, start + n + 1)
            first += n
        return all_tables, all_lens

    def _slots(self, table: list[int], n: int) -> np.ndarray:
        """Slots of positions 0..n-1 of a sequence with this block table -> [n] int64."""
        blocks = np.asarray(table, np.int64)[:, None] * self.block_size  # [W, 1]
        return (blocks + np.arange(self.block_size)).reshape(-1)[:n]  # [W, bs] -> [n]

    # ---- the forward ----
    def run(self, inp: StepInputs, prev: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """inp: prepare's (host tensors) -> (logits [R, V] of inp.sample_rows (model dtype), head [2, R] int64: their
        greedy tokens and whether each row's logits are all finite; a graph's buffers, rewritten by its next
        replay). prev: the previous step's tokens [R'] on the device, which inp.feed takes the decode rows' input
        ids from (the step runs after it on the same stream: nothing waits)."""
        self.tp.begin(inp, prev)
        inp = self.placed(inp)
        if inp.graph_key is not None:
            logits, head = self.graphs.run(inp, prev)
            R = len(inp.sampled)
            return logits[:R], head[:, :R]
        with torch.inference_mode():
            feed_ids(inp.ids, inp.feed, prev)
            return self.forward_head(inp)

    def forward(self, inp: StepInputs) -> torch.Tensor:
        """The eager forward as the graphs capture it -> logits [R, V]."""
        with ops.torch_only(not self.use_triton):
            return self._forward(inp)

    def forward_head(self, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's logits and their greedy tokens and finite flags [2, R] (accel.ops.paged.greedy_rows)."""
        with ops.torch_only(not self.use_triton):
            logits = self._forward(inp)
            return logits, greedy_rows(logits)

    def _forward(self, inp: StepInputs) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        eps = cfg.rms_norm_eps
        first_norm, layers = self._schedule(inp)
        x, h = self.tp.embed_norm(inp.ids, w.embed, first_norm, eps)  # [T, D] each
        cos, sin = self.cos[inp.positions], self.sin[inp.positions]  # [T, E/2] fp32
        for i, c, next_norm in layers:  # i: the self layer's index in the paged cache; c: a cross layer's
            if c is not None:
                x, h = self.vision.cross(c, x, h, next_norm, inp.images)
                continue
            lw = w.layers[i]
            a = self._attention(lw, h, cos, sin, i, inp)  # [T, H·E]
            o = self.tp.reduce(self._linear(a, lw.o, i, "o", inp))  # [T, H·E] -> [T, D]
            x, h = ops.add_rms_norm(o, x, lw.mlp_norm, eps)  # resid_mid, mlp_norm
            act = self._gate_up_swiglu(h, lw.gate_up, i, inp)  # [T, D] -> [T, 2F] -> [T, F]
            down = self.tp.reduce(self._linear(act, lw.down, i, "down", inp))  # [T, F] -> [T, D]
            x, h = ops.add_rms_norm(down, x, next_norm, eps)  # resid_post
        if len(inp.sample_rows) < h.shape[0]:  # else every row, in order (rows sampled are listed in order)
            h = h[inp.sample_rows]
        return self.tp.gather(self._dense(h, w.lm_head))  # [R, D] -> [R, V]

    def _schedule(self, inp: StepInputs):
        """(the first layer's input norm, [(self layer i or None, cross layer c or None, the next layer's norm)]):
        a vision model's with its cross layers when the step has image rows (accel/batch/vision.py)."""
        if self.vision is not None:
            return self.vision.schedule(inp.images is not None)
        layers = self.w.layers
        return layers[0].attn_norm, [(i, None, layers[i + 1].attn_norm if i + 1 < len(layers) else self.w.norm)
                                     for i in range(len(layers))]

    def _dense(self, x, weight) -> torch.Tensor:
        return invariant_linear(x, weight) if self.invariant else batched_linear(x, weight)  # [T, Din] -> [T, Dout]

    def _linear(self, x, weight, layer: int, fused: str, inp: StepInputs) -> torch.Tensor:
        """x [T, Din]·Wᵀ over the whole batch, plus each row's LoRA adapter update (one segmented product for all
        the adapters in the step: accel/ops/lora_batch.py)."""
        y = self._dense(x, weight)
        return y if inp.lora_tiles is None else self.lora.add(layer, fused, y, x, inp.lora_tiles)

    def _gate_up_swiglu(self, h, gate_up, layer: int, inp: StepInputs) -> torch.Tensor:
        """silu(h·gateᵀ) · (h·upᵀ) [T, F]: one GEMM with SwiGLU in its epilogue (accel/kernels/matmul.py) where
        the table lists the shape (always in the invariant mode: its one tiling); a step with adapters adds their
        updates to gate and up first, so it keeps the GEMM, the update, then SwiGLU."""
        if inp.lora_tiles is not None:
            return ops.swiglu_gate_up(self._linear(h, gate_up, layer, "gate_up", inp))
        return invariant_swiglu_linear(h, gate_up) if self.invariant else batched_swiglu_linear(h, gate_up)

    def _attention(self, lw, h, cos, sin, layer: int, inp: StepInputs) -> torch.Tensor:
        cfg = self.cfg
        T = h.shape[0]
        H, K, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cache_k, cache_v = self.k_cache[layer], self.v_cache[layer]  # [K, S, E]
        qkv = self._linear(h, lw.qkv, layer, "qkv", inp)  # [T, D] -> [T, (H+2K)·E]
        q, k, v = split_qkv(qkv, H, K, E)
        q_rot = ops.rope_kv_write(q, k, v, cos, sin, cache_k, cache_v, inp.slots)  # k_rot, v -> their slots
        a = torch.empty_like(q_rot)  # [T, H, E]
        D = inp.num_decode
        if D:
            paged_decode_attention(q_rot[:D], cache_k, cache_v, inp.tables, inp.lens, self.block_size, self.invariant,
                                   out=a[:D])
        for first, n, slots in inp.prefills:
            k_seq, v_seq = cache_k[:, slots], cache_v[:, slots]  # [K, S, E] -> [K, ctx, E]: positions 0..ctx-1
            a[first:first + n] = ops.causal_attention(q_rot[first:first + n], k_seq, v_seq,
                                                      inp.positions[first:first + n])
        return a.reshape(T, H * E)
