"""One request's state in the batch engine: its tokens, its sampling parameters, its place in the paged KV cache
(SamplingParams and RequestOutput: refimpl.batch_api, the request API the batch engines share).

    token_ids       prompt then generated tokens
    num_computed    how many of token_ids have their K/V in the cache; the next step computes from there (a prefill
                    chunk, or the one token of a decode step: the same thing at different lengths)
    block_table     logical block i -> physical block of the pool; position p lives at slot
                    `block_table[p // block_size] * block_size + p % block_size`
    block_hashes    chained hash of each full block whose K/V are computed (prefix sharing, block_manager.py),
                    rooted at `prefix_root`, the adapter's name and the digest of the request's images: the same
                    tokens under another adapter, or beside other images, have other K/V
    image_kv        a vision request's image keys/values (accel/batch/vision.py), from its first prefill chunk on
    pending         how many of token_ids' last entries are placeholders: tokens drawn on the device and not read
                    back yet (the engine launches the next step first: engine.py); `pending_row` is the newest one's
                    row in its step's token tensor, from which the next step's input id is copied on the device
Preemption by recompute keeps token_ids and drops the rest (num_computed 0, no blocks, no image keys/values): the
request is prefilled again over prompt + generated tokens and goes on where it stopped.
"""
from __future__ import annotations

import enum

import numpy as np

from refimpl.batch_api import RequestOutput, SamplingParams

PLACEHOLDER = -1  # a token id drawn on the device, not read back yet


def penalized(params: SamplingParams) -> bool:
    """Whether a request's logits are changed before sampling (repetition, presence or frequency penalty)."""
    return params.repetition_penalty != 1 or bool(params.presence_penalty or params.frequency_penalty)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int,
                 stop_ids: frozenset[int], arrival: int, adapter: str | None = None, images=None,
                 images_key: str | None = None):
        """images: refimpl.vision.inputs.ImageInputs (None: a text request); images_key: their digest."""
        self.request_id = request_id
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.seed = seed  # the sampler's key: draws depend on (seed, len(output_ids)) only
        self.stop_ids = stop_ids
        self.arrival = arrival  # FCFS order
        self.adapter = adapter  # the LoRA adapter it runs with (BatchEngine.add_adapter's name), None: the base model
        self.images = images
        self.image_kv = None  # set by the runner at the first prefill chunk, dropped on finish and preemption
        self.image_bytes = 0  # what image_kv takes (accel/batch/vision.py image_kv_bytes), held while running
        self.prefix_root = adapter if images is None else (adapter, images_key)
        self.status = Status.WAITING
        self.num_computed = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.finish_reason: str | None = None
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.num_emitted = 0  # generated tokens already returned by step()
        self.pending = 0
        self.pending_row = -1
        self.greedy = params.temperature == 0
        self.penalized = penalized(params)
        # the sampler's penalty inputs, kept as tokens are read back: the prompt's distinct ids (repetition penalty)
        # and each generated token's count (presence and frequency penalties)
        self.prompt_set = np.unique(np.asarray(prompt_ids, np.int64)) if params.repetition_penalty != 1 else None
        self.counts: dict[int, int] | None = {} if self.penalized else None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        """The generated tokens read back so far."""
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.pending]

    @property
    def num_generated(self) -> int:
        """The generated tokens, those still on the device included (the sampler's draw index of the next)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def append(self, token: int) -> None:
        """A sampled token, known on the host; sets finish_reason when it stops the request."""
        self.resolve(self.push_pending(-1), token)

    def push_pending(self, row: int) -> int:
        """A token drawn on the device at `row` of its step's tokens -> its index in token_ids (a placeholder until
        resolve)."""
        self.token_ids.append(PLACEHOLDER)
        self.pending += 1
        self.pending_row = row
        return len(self.token_ids) - 1

    def resolve(self, index: int, token: int) -> None:
        """The token at `index` read back; sets finish_reason when it stops the request (a stop token drops the
        placeholders after it: tokens drawn past the stop are discarded). An aborted request keeps the token."""
        self.token_ids[index] = token
        self.pending -= 1
        if self.counts is not None:
            self.counts[token] = self.counts.get(token, 0) + 1
        if self.finish_reason is not None:
            return
        if token in self.stop_ids:
            self.finish_reason = "stop"
            del self.token_ids[index + 1:]
            self.pending = 0
        elif index + 1 - self.num_prompt_tokens >= self.params.max_tokens:
            self.finish_reason = "length"

    def output(self) -> RequestOutput:
        """What step() returns for this request: the tokens read back since the last output."""
        end = len(self.token_ids) - self.pending
        new = self.token_ids[self.num_prompt_tokens + self.num_emitted:end]
        self.num_emitted += len(new)
        return RequestOutput(self.request_id, new, self.token_ids[self.num_prompt_tokens:end],
                             self.finish_reason is not None,
                             self.finish_reason, self.num_prompt_tokens,
                             None if self.logprobs is None else list(self.logprobs))
