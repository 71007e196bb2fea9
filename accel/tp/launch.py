"""Starting a tensor-parallel engine from the CLI: the checks, the group, every rank's shard, the serving ranks.

`tp_engine` is what a command uses: rank 0 (the CLI process) gets the engine and the checkpoint's tokenizer and
stop ids; ranks 1..N-1 (spawned here, or started by torchrun) serve until rank 0 leaves the block.
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

from .engine import RankFailed, TPEngine
from .group import TPGroup, from_env, spawn, under_torchrun
from .load import open_text_checkpoint


def _serve(group: TPGroup, model_dir: Path, dtype: str | None) -> None:
    """A spawned rank's life: load its shard, serve rank 0's requests. Its own input error prints as one line
    (unless rank 0 failed too and says it); another rank's failure is rank 0's to report."""
    try:
        TPEngine.load(group, model_dir, dtype).serve()
    except RankFailed:
        pass
    except Llama32Error as e:
        print(f"error: rank {group.rank}: {one_line(str(e))}", file=sys.stderr)


@contextlib.contextmanager
def tp_engine(model_dir: Path, world: int, device: str | None, dtype: str | None
              ) -> Iterator[tuple[TPEngine, Checkpoint]]:
    """(rank 0's engine, the checkpoint without weights) for the block; the other ranks are released and the group
    ended after it. Under torchrun, a rank other than 0 serves and then exits the process (SystemExit 0)."""
    procs = []
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
        group, procs = spawn(world, device, _serve, (Path(model_dir), dtype))
    try:
        if not group.is_root:  # under torchrun
            try:
                TPEngine.load(group, Path(model_dir), dtype).serve()
            except RankFailed:  # rank 0 says which rank failed, the failing rank why
                raise SystemExit(2) from None
            raise SystemExit(0)
        engine = TPEngine.load(group, Path(model_dir), dtype)
        try:
            yield engine, ckpt
        finally:
            engine.close()
    finally:
        dist.destroy_process_group()
        for p in procs:
            p.join(timeout=60)
