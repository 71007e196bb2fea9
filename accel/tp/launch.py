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


from refimpl.errors import Llama32Error, one_line
from refimpl.family import family_of_config_json
from refimpl.formats.jsonfile import read_config_json
from refimpl.formats.params import Checkpoint
from refimpl.quant.schemes import QuantSpec

from .engine import RankFailed, TPEngine
from .group import TPGroup, end_group, from_env, spawn, under_torchrun
from .load import check_quant, open_text_checkpoint
from .vision_engine import TPVisionEngine
from .vision_load import open_vision_checkpoint


def engine_class(model_dir: Path) -> type[TPEngine]:
    """TPVisionEngine for a Llama 3.2 Vision directory (config.json's model_type), else TPEngine."""
    path = Path(model_dir)
    if path.is_dir() and (path / "config.json").is_file():
        if family_of_config_json(read_config_json(path / "config.json")).takes_images:
            return TPVisionEngine
    return TPEngine


def open_checkpoint(model_dir: Path, world: int) -> Checkpoint:
    """The checkpoint's config, tokenizer and stop ids (no weights), every header and the split checked."""
    if engine_class(model_dir) is TPVisionEngine:
        return open_vision_checkpoint(model_dir, world=world)
    return open_text_checkpoint(model_dir, world=world)


def rank_life(group: TPGroup, run) -> None:
    """A spawned rank's life: run() (load its shard, follow rank 0). Its own input error prints as one line (unless
    rank 0 failed too and says it); another rank's failure is rank 0's to report."""
    try:
        run()
    except RankFailed:
        pass
    except Llama32Error as e:
        print(f"error: rank {group.rank}: {one_line(str(e))}", file=sys.stderr)


def _serve(group: TPGroup, model_dir: Path, dtype: str | None, quant: QuantSpec | None) -> None:
    rank_life(group, lambda: engine_class(model_dir).load(group, model_dir, dtype, quant).serve())


@contextlib.contextmanager
def started_group(world: int, device: str | None, open_ckpt, follower, args: tuple
                  ) -> Iterator[tuple[TPGroup, Checkpoint]]:
    """(this process's rank of the group, the checkpoint without weights from open_ckpt()) for the block: under
    torchrun the rank RANK / WORLD_SIZE describe, else rank 0 with ranks 1..N-1 spawned, each running
    follower(group, *args). Every rank reads the checkpoint's headers first: rank 0 alone says what is wrong with
    them. After the block the group is ended and the spawned ranks joined."""
    procs = []
    if under_torchrun():
        try:
            ckpt = open_ckpt()
        except Llama32Error:
            if os.environ["RANK"] != "0":
                raise SystemExit(2) from None
            raise
        group = from_env(world, device)
    else:
        ckpt = open_ckpt()  # the split and the headers checked before any start
        group, procs = spawn(world, device, follower, args)
    try:
        yield group, ckpt
    finally:
        end_group(group)
        for p in procs:
            p.join(timeout=60)


def follow_and_exit(run) -> None:
    """A rank other than 0 under torchrun: run() (follow rank 0 until it leaves), then exit the process (2 when a
    rank failed: rank 0 says which, the failing rank why)."""
    try:
        run()
    except RankFailed:
        raise SystemExit(2) from None
    raise SystemExit(0)


@contextlib.contextmanager
def tp_engine(model_dir: Path, world: int, device: str | None, dtype: str | None, quant: QuantSpec | None = None
              ) -> Iterator[tuple[TPEngine, Checkpoint]]:
    """(rank 0's engine, the checkpoint without weights) for the block; the other ranks are released and the group
    ended after it. Under torchrun, a rank other than 0 serves and then exits the process (SystemExit 0)."""
    check_quant(quant)
    model_dir = Path(model_dir)
    with started_group(world, device, lambda: open_checkpoint(model_dir, world=world), _serve,
                       (model_dir, dtype, quant)) as (group, ckpt):
        engine_type = engine_class(model_dir)
        if not group.is_root:
            follow_and_exit(lambda: engine_type.load(group, model_dir, dtype, quant).serve())
        engine = engine_type.load(group, model_dir, dtype, quant)
        try:
            yield engine, ckpt
        finally:
            engine.close()
