"""Per-request sampling on the device for a batch of logits rows, with accel.sampling's rules row by row:

    repetition penalty   on the logits of the request's tokens so far (prompt and output; HF's rule), before the rest
    presence, frequency  OpenAI's: each generated token's logit minus presence_penalty + frequency_penalty · count
    temperature 0        greedy (argmax, the first of equal maxima)
    else                 top-k, then top-p over logits / temperature, then one draw: argmax(p / e), e ~ Exp(1)

The draw's noise is a counter-based hash of (the request's seed, how many tokens it has generated, the vocabulary
index), not a stateful generator: a request's draws depend on nothing else in the batch, and a preempted request
recomputed later draws the same numbers again. Same seed -> same tokens, whatever shares the batch.
"""
from __future__ import annotations

import numpy as np
import torch

from .host_copy import to_device
from .sequence import Sequence

_M32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2^32): xorshift-multiply rounds whose odd
    multipliers are below 2^31, so no product leaves int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: list[int], steps: list[int], vocab: int, device) -> torch.Tensor:
    """[R, V] float32 in (0, 1): row r a function of (seeds[r], steps[r]) and the column only."""
    seed = to_device(seeds, torch.int64, device)  # [R]
    step = to_device(steps, torch.int64, device)
    key = _mix((seed & _M32) ^ _mix(((seed >> 32) & _M32) ^ _mix(step & _M32)))  # [R]
    col = torch.arange(vocab, dtype=torch.int64, device=device)  # [V]
    bits = _mix(_mix((key[:, None] + col[None, :] * 0x9E3779B1) & _M32) ^ key[:, None])  # [R, V]
    return ((bits.double() + 0.5) / 2.0**32).float()


def _pending_tokens(seqs: list[Sequence], prev: torch.Tensor | None, dev) -> tuple | None:
    """The rows of seqs whose last token is still on the device -> (those rows [Rp], their tokens [Rp] read from
    prev, the previous step's tokens), both on the device; None if none."""
    rows = [j for j, s in enumerate(seqs) if s.pending]
    if not rows:
        return None
    src = to_device([seqs[j].pending_row for j in rows], torch.int64, dev)
    return to_device(rows, torch.int64, dev), prev[src]


def penalize_rows(logits: torch.Tensor, seqs: list[Sequence], prev: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] fp32 -> the same with each row's repetition penalty applied to its request's seen tokens, then
    its presence and frequency penalties to the tokens it generated. prev: the previous step's tokens [R'] on the
    device, where a request's last token (Sequence.pending_row) still is. Built for all penalised rows at once from
    what each sequence keeps (its prompt's distinct ids, its generated tokens' counts): no pass over its tokens."""
    rows = [r for r, s in enumerate(seqs) if s.penalized]
    if not rows:
        return logits
    dev, V = logits.device, logits.shape[1]
    pen = [seqs[r] for r in rows]
    flat = lambda parts: to_device(np.concatenate(parts), None, dev)  # noqa: E731
    counts = torch.zeros(len(pen) * V, dtype=torch.float32, device=dev)  # [P·V]: generated tokens' counts
    ids = [np.fromiter(s.counts, np.int64, len(s.counts)) + j * V for j, s in enumerate(pen) if s.counts]
    if ids:
        n = [np.fromiter(s.counts.values(), np.float32, len(s.counts)) for s in pen if s.counts]
        counts.index_put_((flat(ids),), flat(n), accumulate=True)
    on_device = _pending_tokens(pen, prev, dev)
    if on_device is not None:
        j, token = on_device
        counts.index_put_((j * V + token,), torch.ones_like(token, dtype=torch.float32), accumulate=True)
    seen = counts > 0  # [P·V]: the prompt's tokens added below
    prompts = [s.prompt_set + j * V for j, s in enumerate(pen) if s.prompt_set is not None]
    if prompts:
        seen[flat(prompts)] = True
    counts, seen = counts.view(len(pen), V), seen.view(len(pen), V)
    column = lambda values: to_device(values, torch.float32, dev)[:, None]  # noqa: E731  [P, 1]
    rep = column([s.params.repetition_penalty for s in pen])
    index = to_device(rows, torch.int64, dev)
    vals = logits[index]  # [P, V]
    vals = torch.where(seen, torch.where(vals > 0, vals / rep, vals * rep), vals)
    cost = column([s.params.presence_penalty for s in pen]) + column([s.params.frequency_penalty for s in pen]) * counts
    logits[index] = vals - torch.where(counts > 0, cost, torch.zeros_like(cost))
    return logits


def launch_logprobs(logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> tuple | None:
    """For the rows whose request asks for logprobs, the model's distribution (log-softmax of the raw logits): the
    drawn token's logprob and the top alternatives, on their way to the host (read them with logprob_entries once
    the step's copies are done) -> None if no row asks."""
    rows = [r for r, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return None
    idx = to_device(rows, torch.int64, logits.device)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)  # [Rl, V]
    chosen = lp.gather(1, tokens[idx][:, None])[:, 0]  # [Rl]
    top = torch.topk(lp, max(seqs[r].params.logprobs for r in rows), dim=-1)  # k = 0: empty rows
    host = [t.to("cpu", non_blocking=True) for t in (chosen, top.values, top.indices, tokens[idx])]
    return rows, [seqs[r].params.logprobs for r in rows], host


def logprob_entries(launched: tuple | None) -> list:
    """launch_logprobs' copies read -> [(row, (token, logprob, [(id, logprob)] top alternatives))]."""
    if launched is None:
        return []
    rows, ks, host = launched
    chosen, top_v, top_i, tok = (t.tolist() for t in host)
    return [(r, (tok[j], chosen[j], list(zip(top_i[j], top_v[j]))[:ks[j]])) for j, r in enumerate(rows)]


def sample(logits: torch.Tensor, seqs: list[Sequence], prev: torch.Tensor | None = None,
           greedy: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] (row r: the next token of seqs[r]) -> token ids [R] int64 on the device. greedy: the logits'
    argmax [R] where already computed (the runner's head): returned itself when every row is greedy without
    penalties (the common case: no work here), else unused. prev: penalize_rows'."""
    drawn = [r for r, s in enumerate(seqs) if not s.greedy]
    penalized = any(s.penalized for s in seqs)
    if not drawn and not penalized and greedy is not None:
        return greedy
    if drawn or penalized:
        logits = penalize_rows(logits.float().clone(), seqs, prev)
    tokens = torch.argmax(logits, dim=-1)  # [R]: the greedy rows' answer
    if not drawn:
        return tokens
    rows = to_device(drawn, torch.int64, logits.device)
    params = [seqs[r].params for r in drawn]
    dev, V = logits.device, logits.shape[1]
    temperature = to_device([p.temperature for p in params], torch.float32, dev)
    z = logits[rows] / temperature[:, None]  # [Rs, V]
    z = _top_k(z, [p.top_k for p in params])
    p = torch.softmax(z, dim=-1)
    p = _top_p(p, [p_.top_p for p_ in params])
    e = -torch.log(uniform_noise([seqs[r].seed for r in drawn], [seqs[r].num_generated for r in drawn], V, dev))
    tokens[rows] = torch.argmax(p / e, dim=-1)  # argmax(p / e), e ~ Exp(1): a draw from p
    return tokens


def _top_k(z: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Keep each row's k largest values (ties at the k-th kept); k = 0 or >= V: the whole row."""
    V = z.shape[1]
    ks = [k if 0 < k < V else V for k in ks]
    if all(k == V for k in ks):
        return z
    k = to_device(ks, torch.int64, z.device)  # [Rs]
    top = torch.topk(z, max(ks), dim=-1).values  # [Rs, kmax], largest first
    kth = top.gather(1, (k.clamp_max(top.shape[1]) - 1)[:, None])  # [Rs, 1]
    return z.masked_fill(z < kth, float("-inf"))


def _top_p(p: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """Keep each row's smallest most-likely-first prefix whose mass reaches its top_p; renormalize."""
    if all(x >= 1 for x in ps):
        return p
    top_p = to_device(ps, torch.float32, p.device)[:, None]  # [Rs, 1]
    sorted_p, order = torch.sort(p, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep_sorted = (mass_before < top_p) | (top_p >= 1)
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum(dim=-1, keepdim=True)
