"""Which sequences run in the next step, and how many of their tokens: FCFS with chunked prefill and preemption.

Every sequence is scheduled the same way: `num_uncomputed` tokens wait for their K/V (a whole prompt, what is left of
a chunked one, or the one token a decode step feeds), and a step takes as many as the token budget
(`max_num_batched_tokens`) leaves. Running sequences go first, oldest first, so decodes never starve behind
prefills; then waiting ones are admitted (oldest first, at most `max_num_seqs` running) while budget and blocks last.
When the pool cannot hold a running sequence's next tokens, the newest running sequence is preempted: its blocks are
freed and it goes back to the front of the waiting queue, to be recomputed from its tokens later (never an
out-of-memory error). A step that preempted admits nobody new. A vision model's requests with images are admitted
only while their image keys/values fit the bytes kept for them (`image_budget`), or they wait.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass(slots=True)
class Scheduled:
    seq: Sequence
    num_tokens: int  # token_ids[num_computed : num_computed + num_tokens] go through the model this step

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last token, so its last row's logits give a new token."""
        return self.seq.num_computed + self.num_tokens == len(self.seq)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 image_budget: int | None = None):
        """image_budget: the bytes running requests' image keys/values may take (None: no images)."""
        self.blocks = blocks
        self.image_budget = image_budget
        self.image_bytes = 0  # what the running requests' images hold
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0
        self.prefix_cached_tokens = 0  # prompt tokens admitted with their K/V already cached (prefix sharing)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Scheduled]:
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        preempted = False
        bs = self.blocks.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            end = min(len(seq.token_ids), seq.num_computed + budget)  # n = end - num_computed tokens this step
            if end <= len(seq.block_table) * bs:  # most decode steps: the last block has room
                out.append(Scheduled(seq, end - seq.num_computed))
                budget -= end - seq.num_computed
                i += 1
                continue
            n = end - seq.num_computed
            while not self.blocks.can_append(seq, n) and self.running[-1] is not seq:
                self._preempt(self.running.pop())
                preempted = True
            if not self.blocks.can_append(seq, n):  # seq itself is the newest: it waits for the others
                self._preempt(self.running.pop())
                preempted = True
                break
            self.blocks.may_append(seq, n)
            out.append(Scheduled(seq, n))
            budget -= n
            i += 1
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if seq.image_bytes and self.image_bytes + seq.image_bytes > self.image_budget:
                break  # its images' keys/values wait for a running request's to be freed
            matched = self.blocks.match_prefix(seq) if not seq.block_table else 0
            n = min(seq.num_uncomputed, budget)
            if not self.blocks.can_append(seq, n):
                self.blocks.free(seq)  # give back the prefix it matched; it tries again next step
                break
            self.blocks.may_append(seq, n)
            self.waiting.popleft()
            self.prefix_cached_tokens += matched
            seq.status = Status.RUNNING
            self.image_bytes += seq.image_bytes
            self.running.append(seq)
            out.append(Scheduled(seq, n))
            budget -= n
        return out

    def _release(self, seq: Sequence) -> None:
        """A running sequence's blocks and image keys/values go back."""
        self.blocks.free(seq)
        seq.image_kv = None
        if seq.status is Status.RUNNING:
            self.image_bytes -= seq.image_bytes

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)  # its images are encoded again when it is readmitted
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Done (stopped, at its length, or aborted): its blocks go back to the pool."""
        self._release(seq)
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
