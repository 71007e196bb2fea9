"""What was alive at a CUDA memory peak: a summary of torch.cuda.memory._snapshot()'s allocator trace.

Record a step under torch.cuda.memory._record_memory_history(), take the snapshot, and pass its trace to
peak_allocations: the peak, and the allocations alive at it grouped by the code that made them (the frames in the
project, transformers, PEFT, or torch's optimizer and checkpointing). tools/bench/hf_attention.py's `--kinds memory`
prints it for a training step.
"""
from __future__ import annotations

WHERE = ("accel/", "tools/", "transformers/", "peft/", "torch/optim/", "torch/utils/checkpoint")  # frames that say why


def frame_label(frames: list[dict], depth: int = 2) -> str:
    """An allocation's Python stack (innermost first, as CUDA memory snapshots list it) as its `depth` innermost
    frames in the project, transformers, PEFT or torch's optimizer / checkpoint code: 'file.py:line name < ...'."""
    picked = [f for f in frames if any(w in f["filename"] for w in WHERE)][:depth]
    if not picked:
        return "(no Python frame: the autograd engine's own ops)"
    return " < ".join(f"{'/'.join(f['filename'].split('/')[-2:])}:{f['line']} {f['name']}" for f in picked)


def alive_at(trace: list[dict], start_bytes: int, stop: int) -> tuple[dict, int]:
    """A CUDA memory trace's events up to index `stop`, from `start_bytes` allocated when recording began ->
    (the allocations made since recording and alive after event `stop` {addr: event}, the bytes of those made
    before recording and still alive)."""
    alive: dict[int, dict] = {}
    before = start_bytes
    for e in trace[:stop + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_completed" and alive.pop(e["addr"], None) is None:
            before -= e["size"]  # allocated before recording began
    return alive, before


def peak_allocations(trace: list[dict], start_bytes: int, top: int = 20, depth: int = 2) -> dict:
    """Replay a CUDA memory snapshot's trace (torch.cuda.memory._snapshot()["device_traces"][device]: 'alloc' and
    'free_completed' events with addr, size and frames) from `start_bytes` allocated when recording began -> the
    peak ('peak_bytes'), what was allocated before recording and still alive then ('before_bytes'), the
    allocations made since and alive at the peak grouped by frame_label ('groups': the `top` largest, as
    [label, bytes, count]), and the frames of the allocation that reached the peak ('at_peak')."""
    total, peak, peak_at, sizes = start_bytes, start_bytes, -1, {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            sizes[e["addr"]] = e["size"]
            total += e["size"]
        elif e["action"] == "free_completed":
            total -= sizes.pop(e["addr"], e["size"])
        if total > peak:
            peak, peak_at = total, i
    alive, before = alive_at(trace, start_bytes, peak_at)
    groups: dict[str, list] = {}
    for e in alive.values():
        label = frame_label(e.get("frames", []), depth)
        g = groups.setdefault(label, [label, 0, 0])
        g[1] += e["size"]
        g[2] += 1
    ranked = sorted(groups.values(), key=lambda g: -g[1])
    return {"peak_bytes": peak, "before_bytes": before, "groups": ranked[:top],
            "at_peak": frame_label(trace[peak_at].get("frames", []), 6) if peak_at >= 0 else ""}
