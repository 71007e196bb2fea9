"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, reference counted, shared by prefix.

A sequence holds a block table (logical block -> physical block). A block whose `block_size` tokens all have their
K/V computed gets a hash chained from the previous block's (so equal hashes mean equal whole prefixes) and is
registered under it: a later request whose prompt starts with the same full blocks takes them (reference count + 1)
instead of computing them again. A block is registered only once computed, never at allocation: a request admitted
in the same step as the one computing the block must not read it before it is written.

Freed blocks (reference count 0) go to the back of the free list and keep their hash, so a prefix stays reusable
until its block is handed out again (the least recently freed first). Nothing here touches a tensor.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from .sequence import Sequence


def block_hash(prev: int | None, tokens: list[int], root=None) -> int:
    """The key of a full block: its token ids chained with the previous block's key; the first block's chain starts
    at the sequence's root (Sequence.prefix_root: its adapter, and its images if any: K/V depend on them)."""
    return hash((("root", root) if prev is None else prev, *tokens))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and computed
    token_ids: tuple[int, ...] = field(default=())  # checked on a hash hit: a hash collision never shares K/V


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # oldest first
        self.cached: dict[int, int] = {}  # hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    # ---- allocation ----
    def _take_free(self) -> int:
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]  # its old contents are about to be overwritten
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_ids[block_id]
        block.ref_count += 1

    def match_prefix(self, seq: Sequence) -> int:
        """A sequence without blocks takes the cached blocks of its longest prefix of full blocks, leaving at least
        its last token to compute (the step that computes it gives the next token's logits). Returns the number of
        tokens now counted as computed."""
        assert not seq.block_table and seq.num_computed == 0
        bs, prev = self.block_size, None
        for i in range((len(seq) - 1) // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = block_hash(prev, tokens, seq.prefix_root)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            prev = h
        seq.num_computed = len(seq.block_table) * bs
        return seq.num_computed

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """How many more blocks seq needs to hold num_computed + num_tokens tokens."""
        return self.blocks_for(seq.num_computed + num_tokens) - len(seq.block_table)

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the pool has the blocks for seq to hold num_computed + num_tokens tokens."""
        return self.blocks_needed(seq, num_tokens) <= len(self.free_ids)

    def may_append(self, seq: Sequence, num_tokens: int) -> None:
        """Give seq the blocks it needs to hold num_computed + num_tokens tokens (can_append must hold)."""
        need = self.blocks_needed(seq, num_tokens)
        assert need <= self.num_free, "may_append without can_append"
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def commit(self, seq: Sequence) -> None:
        """After a step computed seq's tokens up to num_computed: register the blocks that became full."""
        bs = self.block_size
        full = seq.num_computed // bs
        if full <= len(seq.block_hashes):  # most steps: no block filled up
            return
        for i in range(len(seq.block_hashes), full):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = block_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens, seq.prefix_root)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = h, tuple(tokens)
                self.cached.setdefault(h, block.block_id)  # an equal block already registered stays the one shared

    def commit_all(self, seqs) -> None:
        """commit for each of seqs, skipping at once those whose last full block is registered (most of a step's)."""
        bs = self.block_size
        for seq in seqs:
            if seq.num_computed // bs > len(seq.block_hashes):
                self.commit(seq)

    def free(self, seq: Sequence) -> None:
        """Drop seq's blocks (finished, aborted or preempted). The last block goes to the free list first, so it
        is handed out again first: a prefix's head stays cached longer than its tail."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_ids[block_id] = None
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
