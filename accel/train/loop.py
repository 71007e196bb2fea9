"""The optimisation loop: batching, loss normalisation, learning-rate schedule, optimiser step, checkpoints.

Loss of an optimiser step = summed cross-entropy over every label token of the step (all its micro-batches) divided
by their count, as HF computes it when `num_items_in_batch` is passed: the count is known before the first
micro-batch runs, so each micro-batch's backward already carries its final weight and gradients simply accumulate.
Schedule: linear warm-up from 0 over --warmup-steps, then linear decay to 0 at the last step (HF's default).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from refimpl.train.data import IGNORE, Sample


@dataclass(frozen=True)
class TrainSettings:
    lr: float = 1e-4
    optimizer: str = "adamw"  # or "sgd": p -= lr · grad, nothing else
    weight_decay: float = 0.0
    warmup_steps: int = 0
    epochs: int = 1
    max_steps: int | None = None  # overrides epochs
    batch_size: int = 1
    grad_accum: int = 1
    seed: int = 0
    save_every: int | None = None


def lr_at(step: int, s: TrainSettings, total: int) -> float:
    """Learning rate of optimiser step `step` (0-based) out of `total`."""
    if step < s.warmup_steps:
        return s.lr * step / s.warmup_steps
    return s.lr * max(0.0, (total - step) / max(1, total - s.warmup_steps))


def plan_steps(samples: list[Sample], s: TrainSettings) -> list[list[list[Sample]]]:
    """Optimiser steps, each a list of micro-batches of samples: shuffled per epoch with --seed, epochs repeated
    until --max-steps when given (a trailing partial step of an epoch is kept, as HF does)."""
    rng = random.Random(s.seed)
    steps = []
    per_epoch = math.ceil(math.ceil(len(samples) / s.batch_size) / s.grad_accum)
    epochs = s.epochs if s.max_steps is None else math.ceil(s.max_steps / per_epoch)
    for _ in range(epochs):
        order = list(samples)
        rng.shuffle(order)
        micro = [order[i:i + s.batch_size] for i in range(0, len(order), s.batch_size)]
        steps += [micro[i:i + s.grad_accum] for i in range(0, len(micro), s.grad_accum)]
    return steps if s.max_steps is None else steps[:s.max_steps]


def collate(batch: list[Sample], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sample: ids [B, T] (pad id 0, never attended by real tokens), labels [B, T]."""
    T = max(len(x.ids) for x in batch)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    labels = torch.full((len(batch), T), IGNORE, dtype=torch.long)
    for row, x in enumerate(batch):
        ids[row, :len(x.ids)] = torch.tensor(x.ids)
        labels[row, :len(x.labels)] = torch.tensor(x.labels)
    return ids.to(device), labels.to(device)


def make_optimizer(params, s: TrainSettings):
    if s.optimizer == "sgd":
        return None
    return torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=s.weight_decay)


@torch.no_grad()
def _apply(params, optimizer, lr: float) -> None:
    if optimizer is None:  # plain SGD, so that one step can be checked exactly
        for p in params:
            p.sub_(lr * p.grad)
    else:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    for p in params:
        p.grad = None


def train(model, samples: list[Sample], s: TrainSettings, device, on_step: Callable[[dict], None],
          save: Callable[[str | None], None]) -> dict:
    """Run every planned step; `save(None)` writes the final adapter, `save(name)` a checkpoint. Ctrl-C saves the
    adapter as it stands (its steps so far) before the KeyboardInterrupt goes on. `model.collate(batch, device)`
    gives model.loss_sum's arguments (the vision trainer's add the images)."""
    params = model.parameters()
    optimizer = make_optimizer(params, s)
    steps = plan_steps(samples, s)
    torch.manual_seed(s.seed)  # LoRA dropout masks
    done, tokens_total, t_start = 0, 0, time.perf_counter()
    try:
        for step, micro_batches in enumerate(steps):
            t0 = time.perf_counter()
            n_labels = sum(x.n_labels for batch in micro_batches for x in batch)
            loss_sum = 0.0
            for batch in micro_batches:
                part, _ = model.loss_sum(*model.collate(batch, device))
                (part / max(n_labels, 1)).backward()
                loss_sum += float(part.detach())
            lr = lr_at(step, s, len(steps))
            _apply(params, optimizer, lr)
            done = step + 1
            tokens = sum(len(x.ids) for batch in micro_batches for x in batch)
            tokens_total += tokens
            if device_is_cuda(device):
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            on_step({"step": done, "loss": loss_sum / max(n_labels, 1), "lr": lr, "tokens": tokens,
                     "tokens_per_s": tokens / dt if dt > 0 else None})
            if s.save_every and done % s.save_every == 0 and done < len(steps):
                save(f"checkpoint-{done}")
    except KeyboardInterrupt:
        save(None)
        raise
    save(None)
    return {"steps": done, "tokens": tokens_total, "seconds": time.perf_counter() - t_start}


def device_is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


@torch.no_grad()
def evaluate(model, samples: list[Sample], batch_size: int, device) -> float:
    """Mean cross-entropy over every label token of `samples` (no dropout)."""
    model.training = False
    total, count = 0.0, 0
    try:
        for i in range(0, len(samples), batch_size):
            part, n = model.loss_sum(*model.collate(samples[i:i + batch_size], device))
            total, count = total + float(part), count + n
    finally:
        model.training = True
    return total / max(count, 1)
