"""Sampling on the device, with the rules of refimpl.generate.sample, and no host sync.

    temperature 0     greedy (argmax)
    else              z = logits / temperature; top-k keeps the k largest z (ties at the k-th value kept);
                      top-p keeps the smallest most-likely-first prefix whose probability mass reaches top_p;
                      then one draw from the renormalized distribution.
The draw is `argmax(p / e)` with e ~ Exponential(1) from a seeded torch.Generator (the exponential-race form of
a categorical draw, as gpt-fast samples): it needs no cumulative sum or host-side search, so the token stays on
the device and the next decode step can be queued before the host reads it. Same seed, same device -> same tokens;
the draws are not NumPy's, so a seeded accel run and a seeded refimpl run pick different tokens.
"""
from __future__ import annotations

import torch

from refimpl.generate import Sampling

from .ops import argmax_row


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()  # a fresh nondeterministic seed
    else:
        g.manual_seed(seed)
    return g


def probabilities(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [V] -> the distribution a token is drawn from, [V] float32 (temperature > 0)."""
    z = logits.float() / s.temperature  # [V]
    if 0 < s.top_k < z.numel():
        kth = torch.topk(z, s.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    p = torch.softmax(z, dim=-1)
    if s.top_p < 1:
        sorted_p, order = torch.sort(p, descending=True)  # [V], most likely first
        mass_before = torch.cumsum(sorted_p, dim=0) - sorted_p  # probability of the tokens ranked above
        keep_sorted = mass_before < s.top_p  # the prefix up to and including the one that reaches top_p
        keep = torch.zeros_like(keep_sorted).scatter_(0, order, keep_sorted)
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum()
    return p


def sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator) -> torch.Tensor:
    """logits [1, V] or [V] -> token id [1] int64 on the same device."""
    logits = logits.reshape(-1)
    if s.temperature == 0:
        return argmax_row(logits)
    p = probabilities(logits, s)
    e = torch.empty_like(p).exponential_(generator=generator)  # e ~ Exp(1): argmax(p / e) ~ Categorical(p)
    e.clamp_min_(1e-30)  # a draw of exactly 0 would make 0/0 = NaN for a cut token, and argmax picks NaN
    return argmax_row(p / e)
