"""The batched engine (accel.batch) over a tensor-parallel group: rank 0 drives, every rank runs each step on its shard.

Rank 0 holds the BatchEngine: scheduler, block manager, sampling, outputs. Each step its runner first tells the
other ranks what to run (`Lead.begin`: the step's inputs, broadcast), then every rank runs the same ModelRunner
forward over its shard (accel.tp.shard): its KV heads' slice of the paged pool (K/N heads a rank, the same block ids
on every rank), the vocab-parallel embedding all-reduced, an all-reduce after o and after down, the logits
all-gathered. Rank 0 alone samples. Decode-only steps replay CUDA graphs on every rank with the collectives captured
inside them: every rank captures the same (bucket, width) keys in the same order, the key being part of the
message. Aborts, preemptions and prefix sharing are rank 0's bookkeeping only: the others run the slots and tables
they are sent.

Messages (int64, broadcast from rank 0): a header [op, T, decode rows, table rows, table width, prefill chunks,
sampled rows, graph rows, graph width, payload length], then for op STEP the payload: ids, positions and slots (T
each), the tables (rows·width) and lens (rows) of the paged rows, (first row, rows, context) per prefill chunk, each
chunk's context slots, the sampled rows. op STOP: the followers leave `follow`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.errors import GenerationError

from .. import ops
from ..batch.block_manager import BlockManager
from ..batch.engine import DEFAULT_BLOCK_SIZE, BatchEngine, kv_pool_blocks
from ..batch.runner import ModelRunner, StepInputs
from .engine import RankFailed, TPEngine
from .group import TPGroup, failed_ranks, sigint_deferred
from .shard import ShardPlan

STOP, STEP = 0, 1
HEADER = 10


class Collectives:
    """A rank's collectives in the runner's forward (accel/batch/collectives.py's contract)."""

    def __init__(self, group: TPGroup, plan: ShardPlan):
        self.group, self.world = group, group.world
        self.first_id, _ = plan.vocab_range()
        self.vocab = plan.cfg.vocab_size

    def begin(self, inp: StepInputs) -> None:
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

    def begin(self, inp: StepInputs) -> None:
        header, payload = pack(inp)
        _broadcast(torch.tensor(header, dtype=torch.int64).to(self.group.device))
        _broadcast(payload.to(self.group.device))

    def stop(self) -> None:
        _broadcast(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.int64).to(self.group.device))


def _broadcast(t: torch.Tensor) -> torch.Tensor:
    dist.broadcast(t, src=0)
    return t


def pack(inp: StepInputs) -> tuple[list[int], torch.Tensor]:
    """A step's inputs -> (the header, the payload [n] int64 on the inputs' device)."""
    T, (rows, width) = inp.ids.shape[0], tuple(inp.tables.shape)
    key = inp.graph_key or (0, 0)
    chunks = [torch.tensor([f, n, sl.shape[0]], dtype=torch.int64) for f, n, sl in inp.prefills]
    parts = [inp.ids, inp.positions, inp.slots, inp.tables.reshape(-1), inp.lens, *chunks,
             *(sl for _, _, sl in inp.prefills), inp.sample_rows]
    dev = inp.ids.device
    payload = torch.cat([p.to(dev, torch.int64) for p in parts])
    header = [STEP, T, inp.num_decode, rows, width, len(inp.prefills), inp.sample_rows.shape[0], *key,
              payload.shape[0]]
    return header, payload


def unpack(header: list[int], payload: torch.Tensor) -> StepInputs:
    """pack's inverse, on the payload's device (followers sample nothing: `sampled` empty)."""
    _, T, num_decode, rows, width, P, R, g_rows, g_width, _ = header
    sizes = [T, T, T, rows * width, rows, 3 * P]
    ids, positions, slots, tables, lens, meta, rest = torch.split(payload, [*sizes, payload.shape[0] - sum(sizes)])
    meta = meta.reshape(P, 3).tolist() if P else []  # a decode step reads nothing back
    context = torch.split(rest, [c for _, _, c in meta] + [R])
    prefills = [(f, n, sl) for (f, n, _), sl in zip(meta, context)]
    return StepInputs(ids=ids, positions=positions, slots=slots, num_decode=num_decode,
                      tables=tables.reshape(rows, width).to(torch.int32), lens=lens.to(torch.int32),
                      prefills=prefills, sample_rows=context[-1], sampled=[],
                      graph_key=(g_rows, g_width) if g_rows else None)


def receive(device: torch.device) -> StepInputs | None:
    """A follower's next step from rank 0 (None: STOP)."""
    header = _broadcast(torch.zeros(HEADER, dtype=torch.int64, device=device)).tolist()
    if header[0] == STOP:
        return None
    return unpack(header, _broadcast(torch.empty(header[-1], dtype=torch.int64, device=device)))


class TPBatchEngine(BatchEngine):
    """Rank 0's BatchEngine: a step is never cut by Ctrl-C halfway through its collectives; `close` releases the
    other ranks."""

    def step(self):
        with sigint_deferred():
            return super().step()

    def close(self) -> None:
        self.runner.tp.stop()


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


def pool_blocks(group: TPGroup, shard: TPEngine, options: dict) -> int:
    """The paged pool's blocks, the same on every rank: the fewest any rank's memory allows (each rank holds its
    KV heads' share of every block)."""
    def mine() -> int:
        if options.get("num_blocks") is not None:
            return options["num_blocks"]
        return kv_pool_blocks(shard.local, group.device, shard.dtype, options.get("block_size") or DEFAULT_BLOCK_SIZE,
                              options.get("gpu_memory", 0.9), options.get("max_num_seqs", 256),
                              options.get("max_num_batched_tokens", 8192))
    n = torch.tensor([together(group, "size its KV pool", mine)], dtype=torch.int64, device=group.device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return int(n.item())


def batch_engine(group: TPGroup, shard: TPEngine, stop_ids=(), **options) -> TPBatchEngine | None:
    """Rank 0: the engine over its shard (BatchEngine's options: max_num_seqs, max_num_batched_tokens, gpu_memory,
    block_size, num_blocks, cuda_graphs); the other ranks follow rank 0's steps until its `close`, then None."""
    if options.get("batch_invariant"):
        raise GenerationError("--batch-invariant runs on one device only: a sum over ranks follows NCCL's order")
    options = {**options, "num_blocks": pool_blocks(group, shard, options)}
    plan = shard.plan
    if group.is_root:
        return together(group, "start the batch engine", lambda: TPBatchEngine(
            shard.local, shard.weights, group.device, shard.dtype_name, stop_ids, tp=Lead(group, plan), **options))
    runner = together(group, "start the batch engine", lambda: follower_runner(group, shard, options))
    with torch.inference_mode():
        while (inp := receive(group.device)) is not None:
            runner.run(inp)
    return None


def follower_runner(group: TPGroup, shard: TPEngine, options: dict) -> ModelRunner:
    """A follower's runner: the same pool, kernels and graphs as rank 0's, with no scheduler of its own."""
    cuda = group.device.type == "cuda"
    graphs = cuda if options.get("cuda_graphs") is None else options["cuda_graphs"]
    triton = cuda if options.get("use_triton") is None else options["use_triton"]
    blocks = BlockManager(options["num_blocks"], options.get("block_size") or DEFAULT_BLOCK_SIZE)
    return ModelRunner(shard.local, shard.weights, group.device, shard.dtype, blocks, triton, graphs,
                       tp=Collectives(group, shard.plan))
