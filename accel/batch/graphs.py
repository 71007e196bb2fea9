"""CUDA graphs of the decode-only step, one per (batch-size bucket, table width): no step launches a layer from Python.

A decode-only step's B rows are padded up to the next bucket of BUCKETS and its block tables to the next power of two
of blocks (at least MIN_WIDTH, at most the model's context): the paged decode kernel's grid covers the table's width,
so a graph serves every sequence that fits it. Graphs are captured on first use, after two eager warm-up runs on a
side stream (Triton compiles and tunes outside the capture), over static input buffers that each replay's inputs are
copied into; all of them share one memory pool (each replay's logits are read before the next replay). A graph ends
with the rows' greedy tokens and finite-logits flags (accel.ops.paged.greedy_rows), so a greedy step needs no
kernel after its replay but the copy of those out of the graph's buffer.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_WIDTH = 64  # blocks: short contexts share one graph per bucket
GRAPH_INPUTS = ("ids", "positions", "slots", "tables", "lens")  # StepInputs' fields copied into a graph's buffers


def feed_ids(ids: torch.Tensor, feed: torch.Tensor | None, prev: torch.Tensor | None) -> None:
    """ids[feed[0]] = prev[feed[1]] on the device: decode rows whose input token the previous step drew."""
    if feed is not None:
        ids.index_copy_(0, feed[0], prev.index_select(0, feed[1]))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: object  # runner.StepInputs over the static buffers
    logits: torch.Tensor  # [rows, V], rewritten by each replay
    head: torch.Tensor  # [2, rows] int64: greedy tokens and finite flags of the logits, rewritten by each replay


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
        """Replays inp's graph over its inputs (pinned host tensors: copied without waiting), its decode rows fed
        from the previous step's tokens `prev` on the device (runner.feed_ids) -> (logits [rows, V], head [2, rows]:
        runner.forward_head's), both the graph's buffers."""
        g = self.graphs.get(inp.graph_key) or self._capture(inp)
        for name in GRAPH_INPUTS:
            getattr(g.inputs, name).copy_(getattr(inp, name), non_blocking=True)
        feed_ids(g.inputs.ids, inp.feed, prev)
        g.graph.replay()
        return g.logits, g.head

    def _capture(self, inp) -> _Graph:
        dev = self.runner.device
        static = replace(inp, **{name: getattr(inp, name).to(dev) for name in GRAPH_INPUTS})
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
        g = _Graph(graph, static, logits, head)
        self.graphs[inp.graph_key] = g
        return g
