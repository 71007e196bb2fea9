"""CUDA graphs of the decode-only step, one per (batch-size bucket, table width): no step launches a layer from Python.

A decode-only step's B rows are padded up to the next bucket of BUCKETS and its block tables to the next power of two
of blocks (at least MIN_WIDTH, at most the model's context): the paged decode kernel's grid covers the table's width,
so a graph serves every sequence that fits it. Graphs are captured on first use, after two eager warm-up runs on a
side stream (Triton compiles and tunes outside the capture), over static input buffers that each replay's inputs are
copied into; all of them share one memory pool (each replay's logits are read before the next replay). A graph ends
with the rows' greedy tokens and finite-logits flags (accel.ops.paged.greedy_rows), so a greedy step needs no
kernel after its replay but the copy of those out of the graph's buffer.
A graph's static inputs are views of one device buffer (`_Inputs`): a step packs its inputs, and the rows fed from
the previous step's tokens, into one pinned host buffer and sends them in one copy. Rows fed in order (row i from
the previous step's token i, the usual step) take those tokens in one device copy; other feeds index them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_WIDTH = 64  # blocks: short contexts share one graph per bucket
GRAPH_INPUTS = ("ids", "positions", "slots", "tables", "lens")  # StepInputs' fields copied into a graph's buffers


def feed_ids(ids: torch.Tensor, feed: torch.Tensor | None, prev: torch.Tensor | None) -> None:
    """ids[feed[0]] = prev[feed[1]] on the device: decode rows whose input token the previous step drew."""
    if feed is not None:
        ids.index_copy_(0, feed[0], prev.index_select(0, feed[1]))


class _Inputs:
    """One device buffer holding a graph's GRAPH_INPUTS (views of it, `views`) and room for a step's feed (up to
    [2, rows] int64), filled by one copy from a pinned host buffer laid out alike."""

    def __init__(self, inp, device):
        self.fields = []  # (name, byte offset, dtype, shape)
        at = 0
        for name in GRAPH_INPUTS:
            t = getattr(inp, name)
            self.fields.append((name, at, t.dtype, tuple(t.shape)))
            at += -(-t.numel() * t.element_size() // 8) * 8  # 8-byte aligned: the int64 views
        self.feed_at = at
        self.nbytes = at + 2 * inp.ids.shape[0] * 8
        self.device = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.views = {name: self._view(self.device, off, dtype, shape) for name, off, dtype, shape in self.fields}

    @staticmethod
    def _view(buf: torch.Tensor, off: int, dtype, shape) -> torch.Tensor:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return buf[off:off + n].view(dtype).view(shape)

    def send(self, inp) -> torch.Tensor | None:
        """inp's GRAPH_INPUTS and feed (host tensors) into the device buffer in one copy -> the feed [2, F] on the
        device (a view of the buffer), None without one."""
        F = 0 if inp.feed is None else inp.feed.shape[1]
        end = self.feed_at + 2 * F * 8
        host = torch.empty(end, dtype=torch.uint8, pin_memory=True)  # the pinned cache keeps it until copied
        h = host.numpy()
        for name, off, _, _ in self.fields:
            src = getattr(inp, name).numpy().reshape(-1).view(np.uint8)
            h[off:off + src.shape[0]] = src
        if F:
            h[self.feed_at:end] = np.ascontiguousarray(inp.feed.numpy(), np.int64).reshape(-1).view(np.uint8)
        self.device[:end].copy_(host, non_blocking=True)
        return self._view(self.device, self.feed_at, torch.int64, (2, F)) if F else None


def feed_in_order(feed: torch.Tensor) -> bool:
    """Whether a host feed [2, F] feeds rows 0..F-1 from the previous step's tokens 0..F-1, in order."""
    f = feed.numpy()
    return bool((f == np.arange(f.shape[1])).all())


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: object  # runner.StepInputs over the static buffers
    logits: torch.Tensor  # [rows, V], rewritten by each replay
    head: torch.Tensor  # [2, rows] int64: greedy tokens and finite flags of the logits, rewritten by each replay
    buffer: _Inputs  # the static inputs' device buffer


class DecodeGraphs:
    def __init__(self, runner):
        self.runner = runner
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = None

    def key(self, rows: int, width: int) -> tuple[int, int] | None:
        """The (bucket, width) a decode-only step of `rows` sequences and `width` blocks runs under; None: eager."""
        if rows > BUCKETS[-1]:
            return None
        bucket = next(b for b in BUCKETS if b >= rows)
        w = MIN_WIDTH
        while w < width:
            w *= 2
        return bucket, min(w, max(self.runner.max_width, width))

    def run(self, inp, prev: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replays inp's graph over its inputs (host tensors: packed, copied without waiting), its decode rows fed
        from the previous step's tokens `prev` on the device (feed_ids) -> (logits [rows, V], head [2, rows]:
        runner.forward_head's), both the graph's buffers."""
        g = self.graphs.get(inp.graph_key) or self._capture(inp)
        feed = g.buffer.send(inp)
        if feed is not None:
            if feed_in_order(inp.feed):
                F = inp.feed.shape[1]
                g.inputs.ids[:F].copy_(prev[:F])
            else:
                feed_ids(g.inputs.ids, feed, prev)
        g.graph.replay()
        return g.logits, g.head

    def _capture(self, inp) -> _Graph:
        dev = self.runner.device
        buffer = _Inputs(inp, dev)
        buffer.send(replace(inp, feed=None))
        static = replace(inp, **buffer.views)
        static = replace(static, sample_rows=torch.arange(inp.num_decode, device=dev), sampled=[])
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.inference_mode():
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.runner.forward_head(static)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            # thread-local: under --tp the NCCL watchdog thread polls its events while a rank captures
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                logits, head = self.runner.forward_head(static)
        g = _Graph(graph, static, logits, head, buffer)
        self.graphs[inp.graph_key] = g
        return g
