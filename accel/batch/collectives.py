"""What a step's forward shares with other ranks: the runner's four points of contact with a tensor-parallel group
(accel/tp/batch.py), and the one-device default, which shares nothing.

    begin(inp, prev)                before the step: the rank driving the engine tells the others what to run (prev:
                                    the previous step's tokens on the device, where the step feeds rows from them)
    embed_norm(ids, table, norm)    the first layer's input: the embedding (a vocab slice per rank: all-reduced)
                                    and its RMS norm -> (x, h)
    reduce(y)                       after o and down (row-parallel: each rank's product is a partial sum)
    gather(logits)                  the lm_head's rows (a vocab slice per rank) -> the whole vocabulary's
"""
from __future__ import annotations

from .. import ops


class OneDevice:
    def begin(self, inp, prev=None) -> None:
        pass

    def embed_norm(self, ids, table, norm, eps):
        return ops.embedding_rms_norm(ids, table, norm, eps)  # [T] -> x, h [T, D]

    def reduce(self, y):
        return y

    def gather(self, logits):
        return logits


ONE_DEVICE = OneDevice()
