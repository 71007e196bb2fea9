"""The engines at work: batch-1 greedy decode, a batch engine's steps, a prefill call."""
from __future__ import annotations

import statistics
import time

from .timing import device_ms

def prompt_ids(cfg, n: int, seed: int = 0) -> list[int]:
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()


def timed_greedy(engine, sess, prefill, start: int, new_tokens: int, reps: int = 3):
    """(median ms of the new_tokens - 1 greedy graph replays after `prefill()`'s logits, the tokens); the first
    of reps + 1 runs is the warm-up (graph capture)."""
    import torch
    times, tokens = [], None
    for r in range(reps + 1):
        logits = prefill()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        tokens = engine.decode_greedy(sess, logits, start, new_tokens)
        end.record()
        end.synchronize()
        if r:
            times.append(begin.elapsed_time(end))
    return statistics.median(times), tokens


def decode_rate(engine, prompt_len: int = 32, new_tokens: int = 256, reps: int = 3):
    """Batch-1 greedy decode: (steps per second, the prompt, the tokens). The loop never syncs with the host;
    events time the new_tokens - 1 graph replays (+ argmax each), after a prefill outside the timed region."""
    prompt = prompt_ids(engine.config, prompt_len)
    sess = engine.session(prompt_len + new_tokens)
    ms, tokens = timed_greedy(engine, sess, lambda: engine.prefill(prompt, sess), prompt_len, new_tokens, reps)
    return (new_tokens - 1) / (ms * 1e-3), prompt, tokens.tolist()


def sync() -> None:
    """Wait for the GPU (nothing to wait for on the CPU, where tests run a benchmark's loops on a toy model)."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_gpu() -> None:
    """What the last measurement left (its engine, weights) collected and the GPU's cached blocks returned."""
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed_batch_steps(engine, prompts: list[list[int]], warmup: int, steps: int
                      ) -> tuple[list[str], int, float, float]:
    """A batch engine's decode as called: every prompt added (eos ignored; room for `warmup` + `steps` tokens past
    the prompt, for early requests make tokens while later ones still prefill), steps until each has its first
    token, `warmup` untimed steps (a batch size's first decode step captures its CUDA graph), then `steps` timed
    ones -> (the request ids, still running: abort_all ends them; the tokens the timed steps made; their
    seconds; the seconds of prefill and warm-up)."""
    from accel.batch import SamplingParams
    params = SamplingParams(max_tokens=len(prompts[0]) + warmup + steps, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    started = set()
    t0 = time.perf_counter()
    while len(started) < len(ids):
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    for _ in range(warmup):
        engine.step()
    sync()
    t1 = time.perf_counter()
    made = 0
    for _ in range(steps):
        made += sum(len(o.new_token_ids) for o in engine.step())
    sync()
    return ids, made, time.perf_counter() - t1, t1 - t0


def abort_all(engine, ids: list[str]) -> None:
    """The requests `ids` aborted, the engine stepped until it is idle (its blocks free for the next measurement)."""
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    engine.step()  # the aborted requests' outputs


def prefill_call(engine, tokens: int = 2048):
    """A no-argument call of the engine's prefill of a `tokens`-token prompt (built on the device once: no copy
    in the timing) into a session of its own."""
    import torch
    prompt = torch.tensor(prompt_ids(engine.config, tokens, seed=1), device=engine.device)
    sess = engine.session(tokens)
    return lambda: engine.prefill(prompt, sess)


def prefill_gpu_ms(fn) -> float:
    """A prefill call's GPU time alone (device_ms with a spin long enough to queue a 2048-token prefill)."""
    return device_ms(fn, reps=3, sleep_cycles=100_000_000)
