"""The process group of a tensor-parallel run: N processes, one a GPU (nccl) or all on the CPU (gloo).

Two ways in:
    spawned   the CLI process becomes rank 0 and starts ranks 1..N-1 itself (torch.multiprocessing, spawn), each
              running `target(group, *args)`; the rendezvous is 127.0.0.1 on a free port;
    torchrun  every process was started by torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
              MASTER_PORT; `from_env` joins the group it describes.
Rank 0 owns the CLI's stdin and stdout; the other ranks print nothing but their errors.
NVLink multicast stays off on CUDA (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, set before the group
starts): it can take a shared host's GPUs out of service.
"""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from refimpl.errors import GenerationError

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
TIMEOUT = timedelta(minutes=30)  # a collective waits this long for a peer still loading a large shard


@dataclass
class TPGroup:
    rank: int
    world: int
    device: torch.device  # this rank's: cuda:LOCAL_RANK, or cpu

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str, local_rank: int) -> torch.device:
    """--device cpu: every rank on the CPU; cuda (or none given, with CUDA): GPU local_rank."""
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise GenerationError(f"--device {device!r} with --tp: expected cpu or cuda (rank r runs on cuda:r)")
    if not torch.cuda.is_available() or torch.cuda.device_count() <= local_rank:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise GenerationError(f"--tp needs a GPU per rank: rank {local_rank} has none (this machine has {have}); "
                              f"use --device cpu")
    return torch.device("cuda", local_rank)


def init(rank: int, world: int, device: torch.device, addr: str | None = None, port: int | None = None) -> TPGroup:
    """Join the group (gloo on the CPU, nccl on CUDA); addr/port default to MASTER_ADDR / MASTER_PORT."""
    if addr is not None:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    backend = "gloo"
    if device.type == "cpu":  # the ranks share the cores: more threads than cores oversubscribe them
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    if device.type == "cuda":
        os.environ.update(NO_MULTICAST)
        torch.cuda.set_device(device)
        backend = "nccl"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=TIMEOUT)
    return TPGroup(rank, world, device)


def from_env(world: int, device: str | None) -> TPGroup:
    """Under torchrun: the group its variables describe, whose size must be --tp."""
    size = int(os.environ["WORLD_SIZE"])
    if size != world:
        raise GenerationError(f"--tp {world}, but torchrun started {size} processes (--nproc-per-node); make them "
                              f"equal")
    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    return init(int(os.environ["RANK"]), size, rank_device(device, local))


def _child(rank: int, world: int, device: str | None, port: int, target, args) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's (the terminal sends it to every rank)
    group = init(rank, world, rank_device(device, rank), "127.0.0.1", port)
    try:
        target(group, *args)
    finally:
        end_group(group)


def end_group(group: TPGroup) -> None:
    """Leave the group. NCCL's destroy waits until every CUDA graph holding one of its collectives is freed, so
    the graphs a rank's engine captured (kept alive in reference cycles) are collected first."""
    gc.collect()
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    dist.destroy_process_group()


def spawn(world: int, device: str | None, target, args: tuple) -> tuple[TPGroup, list]:
    """Start ranks 1..world-1 running target(group, *args) and join as rank 0 -> (rank 0's group, the processes).
    The children are daemons: they end with this process if it dies first."""
    port = free_port()
    root_device = rank_device(device, 0)
    for r in range(1, world):
        rank_device(device, r)  # every rank's device checked here, in one clear line, before anything starts
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_child, args=(r, world, device, port, target, args), daemon=True)
             for r in range(1, world)]
    for p in procs:
        p.start()
    return init(0, world, root_device, "127.0.0.1", port), procs


def failed_ranks(ok: bool, group: TPGroup) -> list[int]:
    """The ranks that passed ok=False, known to every rank (a rank that failed to load tells the others)."""
    flags = [torch.zeros(1, dtype=torch.int64, device=group.device) for _ in range(group.world)]
    dist.all_gather(flags, torch.tensor([int(ok)], dtype=torch.int64, device=group.device))
    return [r for r, f in enumerate(flags) if not f.item()]


@contextlib.contextmanager
def sigint_deferred():
    """Ctrl-C inside the block raises KeyboardInterrupt after it, not halfway through its collectives (which would
    leave the ranks out of step). Only in the main thread, where Python handles signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hit = []
    previous = signal.signal(signal.SIGINT, lambda *args: hit.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if hit:
        raise KeyboardInterrupt
