"""Starting the batched engine over a tensor-parallel group from the CLI (`llama32 batch --tp N`, `llama32 serve
--tp N`): the group, every rank's shard, the followers.

`tp_batch_engine` is what a command uses: rank 0 (the CLI process) gets the engine (accel.tp.batch.TPBatchEngine)
and the checkpoint's tokenizer and stop ids; ranks 1..N-1 (spawned here, or started by torchrun) run rank 0's steps
until it leaves the block.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from refimpl.formats.params import Checkpoint

from .batch import TPBatchEngine, batch_engine
from .engine import TPEngine
from .group import TPGroup
from .launch import follow_and_exit, rank_life, started_group
from .load import open_text_checkpoint


def _follow(group: TPGroup, model_dir: Path, dtype: str | None, options: dict) -> None:
    rank_life(group, lambda: batch_engine(group, TPEngine.load(group, model_dir, dtype), **options))


@contextlib.contextmanager
def tp_batch_engine(model_dir: Path, world: int, device: str | None, dtype: str | None, **options
                    ) -> Iterator[tuple[TPBatchEngine, Checkpoint]]:
    """(rank 0's batch engine, the checkpoint without weights) for the block; options: BatchEngine's (max_num_seqs,
    max_num_batched_tokens, gpu_memory, block_size, num_blocks, cuda_graphs) and adapters ({name: PEFT LoRA
    directory}). The other ranks are released and the group ended after it. Under torchrun, a rank other than 0
    follows and then exits the process (SystemExit 0)."""
    model_dir = Path(model_dir)
    with started_group(world, device, lambda: open_text_checkpoint(model_dir, world=world), _follow,
                       (model_dir, dtype, options)) as (group, ckpt):
        if not group.is_root:
            follow_and_exit(lambda: batch_engine(group, TPEngine.load(group, model_dir, dtype), **options))
        engine = batch_engine(group, TPEngine.load(group, model_dir, dtype), ckpt.stop_ids, **options)
        try:
            yield engine, ckpt
        finally:
            engine.close()
