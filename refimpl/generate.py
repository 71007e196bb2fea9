"""Sampling and the token loop of the reference engine.

`RefEngine.generate` yields token ids one at a time (the CLI streams and times them). Sampling here is NumPy;
accel samples on the device with the same rules: the repetition penalty first (HF's: the logit of every token
already in the prompt or the output is divided by the penalty when positive, multiplied when negative), then
temperature 0 is greedy, else top-k, then top-p (nucleus) on the temperature-scaled distribution; a seed makes
the draw repeatable.

Both engines share one contract for continuing a sequence (a chat keeping its history in the KV cache):
`generate(ids, s, stop_ids, cache=c, start=n)` writes `ids` at positions n.. of a cache from `new_cache`, whose
slots 0..n-1 already hold the earlier tokens; the last token yielded is not yet in the cache.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from refimpl.model import ops
from refimpl.formats.params import Checkpoint
from refimpl.errors import GenerationError, NonFiniteError, quote
from refimpl.model.llama import KVCache, forward_steps, run_steps


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def sampling_problem(max_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=None, repetition_penalty=1.0,
                     seed_bits: int = 64) -> tuple[str, str, object] | None:
    """The first sampling parameter out of its range -> (its name, what it must be, its value); None when all are
    valid. One set of rules for every way sampling parameters come in (the CLI's flags, the batch engine's
    requests, request files), each naming the parameter its own way. seed_bits: seeds below 2^seed_bits."""
    rules = (("max_tokens", max_tokens, _is_int(max_tokens) and max_tokens > 0, "a positive integer"),
             ("temperature", temperature, _is_real(temperature) and temperature >= 0, "a number >= 0 (0 means greedy)"),
             ("top_p", top_p, _is_real(top_p) and 0 < top_p <= 1, "a number in (0, 1]"),
             ("top_k", top_k, _is_int(top_k) and top_k >= 0, "an integer >= 0 (0 disables it)"),
             ("repetition_penalty", repetition_penalty, _is_real(repetition_penalty) and repetition_penalty > 0,
              "a number > 0 (1 disables it)"),
             ("seed", seed, seed is None or (_is_int(seed) and 0 <= seed < 2 ** seed_bits),
              f"an integer in [0, 2^{seed_bits})"))
    return next(((name, want, value) for name, value, ok, want in rules if not ok), None)


FLAGS = {"max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
         "repetition_penalty": "--repetition-penalty", "seed": "--seed"}  # sampling_problem's names as CLI flags


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None  # torch's generators take 64-bit seeds
    repetition_penalty: float = 1.0  # 1: off

    def __post_init__(self):
        problem = sampling_problem(self.max_new_tokens, self.temperature, self.top_k, self.top_p, self.seed,
                                   self.repetition_penalty)
        if problem is not None:
            name, want, value = problem
            raise GenerationError(f"{FLAGS[name]} must be {want}, got {quote(value)}")


def penalize(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """logits [V], seen [V] bool -> logits [V] with every seen token's logit pushed down by `penalty`
    (divided when positive, multiplied when negative: a plain division would raise a negative logit)."""
    p = np.float32(penalty)
    return np.where(seen, np.where(logits > 0, logits / p, logits * p), logits)


def sample(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    """logits [V] -> one token id."""
    if s.temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / s.temperature  # [V]
    if 0 < s.top_k < z.size:
        kth = np.partition(z, -s.top_k)[-s.top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if s.top_p < 1:
        order = np.argsort(-p, kind="stable")  # most likely first
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, s.top_p)) + 1]  # smallest prefix whose mass reaches top_p
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return int(rng.choice(p.size, p=p))


def check_prompt(prompt_ids: list[int], vocab_size: int, max_new_tokens: int, context: int, start: int = 0) -> None:
    """`context`: the positions available (the model's, or a given cache's); `start`: where the prompt goes."""
    if not prompt_ids:
        raise GenerationError("the prompt is empty: give some text (or token ids) to continue")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise GenerationError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if start + len(prompt_ids) + max_new_tokens > context:
        held = f"{start} earlier tokens + " if start else ""
        raise GenerationError(f"{held}prompt ({len(prompt_ids)} tokens) + --max-new-tokens ({max_new_tokens}) "
                              f"exceeds the context of {context} positions")


def first_nonfinite(steps, all_finite=lambda value: bool(np.isfinite(np.asarray(value)).all())) -> str | None:
    """Drive a forward generator and return the name of the first activation holding NaN or Inf."""
    for name, value in steps:
        if not all_finite(value):
            return name
    return None


def nonfinite_error(steps, position: int, **check) -> NonFiniteError:
    """The error for a step whose logits were not finite, naming the first bad activation of its rerun `steps`
    (the full lookup runs only on failure; the per-step check is one reduction over the logits)."""
    name = first_nonfinite(steps, **check)
    return NonFiniteError(f"NaN or Inf appeared in activation {name or 'logits'!r} at position {position}; "
                          f"generation stopped")


def text_only(inputs: dict) -> None:
    """A text model's engine refuses the prompt inputs only a multimodal model reads (images)."""
    if any(v is not None for v in inputs.values()):
        raise GenerationError(f"this model reads text only; it takes no {', '.join(sorted(inputs))}")


class RefEngine:
    """The NumPy reference engine: float32, one sequence, a KV cache sized to the request."""

    backend = "refimpl"

    def __init__(self, ckpt: Checkpoint):
        self.ckpt, self.config, self.params = ckpt, ckpt.config, ckpt.params

    def new_cache(self, capacity: int) -> KVCache:
        try:
            return KVCache.allocate(self.config, capacity, lambda shape: np.zeros(shape, np.float32))
        except MemoryError:  # np.zeros asks for the whole cache up front; refuse with the size, not a traceback
            c = self.config
            need = 2 * c.num_hidden_layers * c.num_key_value_heads * capacity * c.head_dim * 4
            raise GenerationError(f"the KV cache for {capacity} positions needs {need / 2**30:.1f} GiB, more memory "
                                  f"than is available; lower --max-new-tokens or shorten the prompt") from None

    # Engines exchange activations as NumPy (the debugger compares and swaps values between backends).
    def to_numpy(self, value) -> np.ndarray:
        return np.asarray(value)

    def from_numpy(self, array: np.ndarray, like=None) -> np.ndarray:
        return np.asarray(array, np.float32)

    def steps(self, ids, positions, cache: KVCache, last_logits_only: bool = False, **inputs):
        """The op-by-op forward (a generator of (name, value)) for the debugger and differential tools."""
        text_only(inputs)
        return forward_steps(ops, self.params, self.config, np.asarray(ids, np.int64),
                             np.asarray(positions, np.int64), cache, last_logits_only)

    def logits(self, ids, positions, cache: KVCache, **inputs) -> np.ndarray:
        """Next-token logits [V] after `ids`; NaN/Inf raise NonFiniteError naming the first activation.
        `inputs`: a multimodal engine's extra prompt inputs (images), passed on to `steps`."""
        ids, positions = np.asarray(ids, np.int64), np.asarray(positions, np.int64)
        with np.errstate(all="ignore"):  # non-finite values are reported below by name, not as NumPy warnings
            out = run_steps(self.steps(ids, positions, cache, last_logits_only=True, **inputs))[-1]
            if not np.isfinite(out).all():
                raise nonfinite_error(self.steps(ids, positions, cache, last_logits_only=True, **inputs),
                                      int(positions[0]))
        return out

    def check_prompt(self, prompt_ids: list[int], s: Sampling, context: int, start: int = 0, **inputs) -> None:
        check_prompt(prompt_ids, self.config.vocab_size, s.max_new_tokens, context, start)

    def generate(self, prompt_ids: list[int], s: Sampling, stop_ids=(), cache: KVCache | None = None,
                 start: int = 0, **inputs) -> Iterator[int]:
        """New tokens after the prompt; with `cache` (from new_cache), the prompt goes at positions start.. after
        the earlier tokens already in it (a chat continuing its history)."""
        cfg = self.config
        context = cfg.max_position_embeddings if cache is None else cache.capacity
        self.check_prompt(prompt_ids, s, context, start, **inputs)
        rng = np.random.default_rng(s.seed)
        cache = cache or self.new_cache(len(prompt_ids) + s.max_new_tokens)
        logits = self.logits(prompt_ids, np.arange(start, start + len(prompt_ids)), cache, **inputs)
        pos = start + len(prompt_ids)
        seen = np.zeros(cfg.vocab_size, bool)  # [V]: for the repetition penalty
        seen[[t for t in prompt_ids if t < cfg.vocab_size]] = True  # an image token lies past the logits' rows
        for n in range(s.max_new_tokens):
            if s.repetition_penalty != 1:
                logits = penalize(logits, seen, s.repetition_penalty)
            token = sample(logits, s, rng)
            seen[token] = True
            yield token
            if token in stop_ids or n + 1 == s.max_new_tokens:
                return
            logits = self.logits([token], [pos], cache)
            pos += 1
