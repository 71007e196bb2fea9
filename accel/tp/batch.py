"""The batched engine (accel.batch) over a tensor-parallel group: rank 0 drives, every rank runs each step on its shard.

Rank 0 holds the BatchEngine: scheduler, block manager, sampling, outputs. Each step its runner first tells the
other ranks what to run (`Lead.begin`: the step's inputs, broadcast), then every rank runs the same ModelRunner
forward over its shard (accel.tp.shard): its KV heads' slice of the paged pool (K/N heads a rank, the same block ids
on every rank), the vocab-parallel embedding all-reduced, an all-reduce after o and after down, the logits
all-gathered. Rank 0 alone samples. Decode-only steps replay CUDA graphs on every rank with the collectives captured
inside them: every rank captures the same (bucket, width) keys in the same order, the key being part of the
message. Aborts, preemptions and prefix sharing are rank 0's bookkeeping only: the others run the slots and tables
they are sent.

LoRA adapters (`adapters`: every rank reads the same PEFT directories) are split as their weights are: a
column-parallel weight's lora_B keeps the rank's rows (its heads, its hidden units), a row-parallel weight's lora_A
the rank's columns, so each rank's update of o and down is a partial sum, all-reduced with the weight's own.

The paged pool is rank 0's size (its BatchEngine sizes it from its memory); every other rank allocates the same
blocks for its KV heads, or fails to start naming itself.

Messages: each step's inputs go from rank 0's host to the other ranks' hosts over a gloo group of the same ranks
(`channel`, on the CPU whatever the device), so no rank's host waits for its device to learn what to run next: with
overlapped steps (accel/batch/engine.py) rank 0 sends step n+1 while step n runs, and a follower queues step n+1's
copies and graph replay behind step n on its stream. Two int64 broadcasts: a header [op, T, decode rows, table rows,
table width, prefill chunks, sampled rows, graph rows, graph width, LoRA tiles + 1 (0: none), fed rows, previous
tokens, payload length], then for op STEP the payload: ids, positions and slots (T each), the tables (rows·width)
and lens (rows) of the paged rows, (first row, rows, context) per prefill chunk, each chunk's context slots, the
sampled rows, the LoRA tiles (3 each), the feed (2 · fed rows: a decode row and the row of the previous step's
tokens its input id is taken from, where the engine launches a step before the previous one's tokens reach the
host). The previous step's tokens themselves, where rows are fed, never leave the device: one NCCL broadcast queued
on the stream. op STOP: the followers leave `follow`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.errors import GenerationError

from .. import ops
from ..batch.block_manager import BlockManager
from ..batch.engine import BatchEngine
from ..batch.runner import ModelRunner, StepInputs
from .engine import TPEngine, together
from .group import TIMEOUT, TPGroup, sigint_deferred
from .shard import ShardPlan

STOP, STEP = 0, 1
HEADER = 13


class Collectives:
    """A rank's collectives in the runner's forward (accel/batch/collectives.py's contract)."""

    def __init__(self, group: TPGroup, plan: ShardPlan):
        self.group, self.world = group, group.world
        self.first_id, _ = plan.vocab_range()
        self.vocab = plan.cfg.vocab_size

    def begin(self, inp: StepInputs, prev=None) -> None:
        pass

    def embed_norm(self, ids, table, norm, eps):
        """ids [T] -> (x, rms_norm(x)) [T, D]: each rank looks up the ids its rows hold (zero for the others), and
        the rows are summed over the ranks."""
        local = ids.to(table.device) - self.first_id  # [T]
        mine = (local >= 0) & (local < table.shape[0])  # [T]
        x = table[local.clamp(0, table.shape[0] - 1)] * mine[:, None].to(table.dtype)  # [Vr, D][T] -> [T, D]
        dist.all_reduce(x)
        return x, ops.rms_norm(x, norm, eps)

    def reduce(self, y):
        dist.all_reduce(y)  # each rank's partial product, summed in place
        return y

    def gather(self, logits):
        """[R, ceil(V/N)] on each rank -> [R, V] on every rank."""
        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=1)[:, :self.vocab].contiguous()  # [R, N·ceil(V/N)] -> [R, V]


class Lead(Collectives):
    """Rank 0's: each step's inputs go to the other ranks before its forward."""

    def __init__(self, group: TPGroup, plan: ShardPlan, channel):
        """channel: message_channel's group, which the step messages go over."""
        super().__init__(group, plan)
        self.channel = channel

    def begin(self, inp: StepInputs, prev=None) -> None:
        """inp: the runner's host tensors; prev: the previous step's tokens on the device, where inp feeds rows
        from them. Nothing here waits for the device."""
        header, payload = pack(inp, prev)
        dist.broadcast(torch.tensor(header, dtype=torch.int64), src=0, group=self.channel)
        dist.broadcast(payload, src=0, group=self.channel)
        if header[-2]:
            dist.broadcast(prev, src=0)

    def stop(self) -> None:
        dist.broadcast(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.int64), src=0, group=self.channel)


def message_channel(group: TPGroup):
    """The gloo group of the step messages, made on every rank (a collective call); on the CPU too, beside the
    default gloo group, so the CPU tests run the GPUs' path."""
    return dist.new_group(backend="gloo", timeout=TIMEOUT)


def pack(inp: StepInputs, prev=None) -> tuple[list[int], torch.Tensor]:
    """A step's inputs (host tensors) -> (the header, the payload [n] int64 on the host)."""
    T, (rows, width) = inp.ids.shape[0], tuple(inp.tables.shape)
    key = inp.graph_key or (0, 0)
    chunks = [torch.tensor([f, n, sl.shape[0]], dtype=torch.int64) for f, n, sl in inp.prefills]
    tiles = [] if inp.lora_tiles is None else [inp.lora_tiles.reshape(-1)]
    fed = [] if inp.feed is None else [inp.feed.reshape(-1)]
    parts = [inp.ids, inp.positions, inp.slots, inp.tables.reshape(-1), inp.lens, *chunks,
             *(sl for _, _, sl in inp.prefills), inp.sample_rows, *tiles, *fed]
    payload = torch.cat([p.to(torch.int64) for p in parts])
    num_tiles = 0 if inp.lora_tiles is None else inp.lora_tiles.shape[0] + 1
    num_fed, num_prev = (0, 0) if inp.feed is None else (inp.feed.shape[1], prev.shape[0])
    header = [STEP, T, inp.num_decode, rows, width, len(inp.prefills), inp.sample_rows.shape[0], *key, num_tiles,
              num_fed, num_prev, payload.shape[0]]
    return header, payload


def unpack(header: list[int], payload: torch.Tensor) -> StepInputs:
    """pack's inverse: host tensors as the runner's prepare makes them, views of the payload or (the int32 ones)
    pinned like it where it is (followers sample nothing: `sampled` empty)."""
    _, T, num_decode, rows, width, P, R, g_rows, g_width, num_tiles, num_fed, _, _ = header
    sizes = [T, T, T, rows * width, rows, 3 * P]
    ids, positions, slots, tables, lens, meta, rest = torch.split(payload, [*sizes, payload.shape[0] - sum(sizes)])
    meta = meta.reshape(P, 3).tolist() if P else []
    tiles = 3 * max(num_tiles - 1, 0)
    *context, sample_rows, lora_tiles, feed = torch.split(rest, [c for _, _, c in meta] + [R, tiles, 2 * num_fed])
    prefills = [(f, n, sl) for (f, n, _), sl in zip(meta, context)]
    pin = payload.is_pinned()

    def int32(t):
        t = t.to(torch.int32)
        return t.pin_memory() if pin else t
    return StepInputs(ids=ids, positions=positions, slots=slots, num_decode=num_decode,
                      tables=int32(tables.reshape(rows, width)), lens=int32(lens), prefills=prefills,
                      sample_rows=sample_rows, sampled=[], graph_key=(g_rows, g_width) if g_rows else None,
                      lora_tiles=int32(lora_tiles.reshape(-1, 3)) if num_tiles else None,
                      feed=feed.reshape(2, num_fed) if num_fed else None)


def receive(device: torch.device, channel) -> tuple[StepInputs, torch.Tensor | None] | None:
    """A follower's next step from rank 0 over `channel` (message_channel's group; its host tensors, pinned on
    CUDA) and the previous step's tokens it feeds rows from (None where it feeds none; on the device, their
    broadcast queued); None: STOP."""
    header = torch.zeros(HEADER, dtype=torch.int64)
    dist.broadcast(header, src=0, group=channel)
    header = header.tolist()
    if header[0] == STOP:
        return None
    payload = torch.empty(header[-1], dtype=torch.int64, pin_memory=device.type == "cuda")
    dist.broadcast(payload, src=0, group=channel)
    prev = None
    if header[-2]:
        prev = torch.empty(header[-2], dtype=torch.int64, device=device)
        dist.broadcast(prev, src=0)
    return unpack(header, payload), prev


class TPBatchEngine(BatchEngine):
    """Rank 0's BatchEngine: a step is never cut by Ctrl-C halfway through its collectives; `close` releases the
    other ranks; adapters are given when it starts (every rank loads its part)."""

    def add_adapter(self, name: str, adapter: list) -> None:
        raise GenerationError(f"adapter {name!r}: a tensor-parallel engine takes its adapters when it starts "
                              f"(batch_engine's adapters)")

    def step(self):
        with sigint_deferred():
            return super().step()

    def close(self) -> None:
        """Release the other ranks; free the CUDA graphs (the group's end waits for them: group.end_group)."""
        self.runner.tp.stop()
        self.runner.graphs = None


def pool_shape(group: TPGroup, engine: BatchEngine | None) -> tuple[int, int]:
    """(blocks, block size) of rank 0's pool, on every rank."""
    t = torch.zeros(2, dtype=torch.int64, device=group.device)
    if engine is not None:
        t.copy_(torch.tensor([len(engine.blocks.blocks), engine.blocks.block_size]))
    dist.broadcast(t, src=0)
    num_blocks, block_size = t.tolist()
    return num_blocks, block_size


def batch_engine(group: TPGroup, shard: TPEngine, stop_ids=(), adapters: dict | None = None,
                 **options) -> TPBatchEngine | None:
    """Rank 0: the engine over its shard (BatchEngine's options: max_num_seqs, max_num_batched_tokens, gpu_memory,
    block_size, num_blocks, cuda_graphs, overlap: the one-GPU engine's defaults; adapters: {name: PEFT
    LoRA directory}, the same on every rank); the other ranks follow rank 0's steps until its `close`, then None."""
    if options.get("batch_invariant"):
        raise GenerationError("--batch-invariant runs on one device only: a sum over ranks follows NCCL's order")
    plan = shard.plan
    channel = message_channel(group)
    engine = together(group, "start the batch engine", lambda: TPBatchEngine(
        shard.local, shard.weights, group.device, shard.dtype_name, stop_ids, tp=Lead(group, plan, channel),
        **options) if group.is_root else None)
    pool = pool_shape(group, engine)
    runner = together(group, "allocate its share of the KV pool", lambda: engine.runner if group.is_root
                      else follower_runner(group, shard, pool, options))
    together(group, "load the LoRA adapters", lambda: add_adapters(runner, plan, adapters or {}))
    if engine is not None:
        return engine
    with torch.inference_mode():
        while (step := receive(group.device, channel)) is not None:
            runner.run(*step)  # rows fed from the previous step's tokens where the engine overlaps its steps
    return None


def follower_runner(group: TPGroup, shard: TPEngine, pool: tuple[int, int], options: dict) -> ModelRunner:
    """A follower's runner: rank 0's pool (blocks, block size), kernels and graphs, with no scheduler of its own."""
    cuda = group.device.type == "cuda"
    graphs = cuda if options.get("cuda_graphs") is None else options["cuda_graphs"]
    triton = cuda if options.get("use_triton") is None else options["use_triton"]
    return ModelRunner(shard.local, shard.weights, group.device, shard.dtype, BlockManager(*pool), triton, graphs,
                       tp=Collectives(group, shard.plan))


def add_adapters(runner: ModelRunner, plan: ShardPlan, adapters: dict) -> None:
    """Each adapter directory's rank part, added in the same order on every rank (a step's tiles name them by
    index)."""
    from refimpl.formats.lora import load_lora
    for name, path in adapters.items():
        runner.add_adapter(str(name), shard_adapter(load_lora(path, plan.cfg), plan))


def shard_adapter(adapter: list, plan: ShardPlan) -> list:
    """load_lora's [(param, A [r, Din], B [Dout, r], scale)] -> this rank's part: a column-parallel weight's B rows
    (the rows its weight keeps), a row-parallel weight's A columns (its update then a partial sum)."""
    out = []
    for param, lora_a, lora_b, scale in adapter:
        s = plan.slice_of(param)
        if s is not None and s.dim == 0:
            lora_b = lora_b[s.start:s.stop]
        elif s is not None:
            lora_a = lora_a[:, s.start:s.stop]
        out.append((param, lora_a, lora_b, scale))
    return out
