"""Starting the batched engine over a tensor-parallel group from the CLI (`llama32 batch --tp N`, `llama32 serve
--tp N`): the group, every rank's shard, the followers.

`tp_batch_engine` is what a command uses: rank 0 (the CLI process) gets the engine (accel.tp.batch.TPBatchEngine)
and the checkpoint's tokenizer and stop ids; ranks 1..N-1 (spawned here, or started by torchrun) run rank 0's steps
until it leaves the block.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from refimpl.errors import Llama32Error, one_line
from refimpl.formats.params import Checkpoint

from .batch import TPBatchEngine, batch_engine
from .engine import RankFailed, TPEngine
from .group import TPGroup, from_env, spawn, under_torchrun
from .load import open_text_checkpoint


def _follow(group: TPGroup, model_dir: Path, dtype: str | None, options: dict) -> None:
    """A spawned rank's life: load its shard, run rank 0's steps. Its own error prints as one line (unless rank 0
    failed too and says it); another rank's failure is rank 0's to report."""
    try:
        batch_engine(group, TPEngine.load(group, model_dir, dtype), **options)
    except RankFailed:
        pass
    except Llama32Error as e:
        print(f"error: rank {group.rank}: {one_line(str(e))}", file=sys.stderr)


@contextlib.contextmanager
def tp_batch_engine(model_dir: Path, world: int, device: str | None, dtype: str | None, **options
                    ) -> Iterator[tuple[TPBatchEngine, Checkpoint]]:
    """(rank 0's batch engine, the checkpoint without weights) for the block; options: BatchEngine's (max_num_seqs,
    max_num_batched_tokens, gpu_memory, block_size, num_blocks, cuda_graphs) and adapters ({name: PEFT LoRA
    directory}). The other ranks are released and the group ended after it. Under torchrun, a rank other than 0 follows and then exits the process (SystemExit 0)."""
    procs, model_dir = [], Path(model_dir)
    if under_torchrun():
        try:  # every rank reads the same files: rank 0 alone says what is wrong with them
            ckpt = open_text_checkpoint(model_dir, world=world)
        except Llama32Error:
            if os.environ["RANK"] != "0":
                raise SystemExit(2) from None
            raise
        group = from_env(world, device)
    else:
        ckpt = open_text_checkpoint(model_dir, world=world)  # the split and the headers checked before any start
        group, procs = spawn(world, device, _follow, (model_dir, dtype, options))
    try:
        if not group.is_root:  # under torchrun
            try:
                batch_engine(group, TPEngine.load(group, model_dir, dtype), **options)
            except RankFailed:
                raise SystemExit(2) from None
            raise SystemExit(0)
        engine = batch_engine(group, TPEngine.load(group, model_dir, dtype), ckpt.stop_ids, **options)
        try:
            yield engine, ckpt
        finally:
            engine.close()
    finally:
        dist.destroy_process_group()
        for p in procs:
            p.join(timeout=60)
