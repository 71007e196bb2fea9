"""What every benchmark shares: the model names and shapes, the argument parser, the results record, and timing.

Benchmarks are leaves over this module: each imports it and the runtime, never another benchmark.
Method (docs/performance.md): CUDA events after warm-up, medians of repeats, random data (never zeros or
uninitialised memory), anything compared measured in the same run. torch is imported where a function needs it,
so the CPU benchmarks (cpu, startup, load, quant_quality) can use the parser and the record without it.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

from refimpl.model.config import PRESETS, LlamaConfig

MODELS = {"1b": "llama-3.2-1b", "3b": "llama-3.2-3b"}  # the text models the GPU benchmarks run, by short name


VISION_11B = {"image_size": 560}  # every other vision field: HF's defaults, the 11B/90B encoder
VISION_CONFIGS = {  # config.json's contents of the Llama 3.2 Vision models, by short name
    "11b-vision": {"model_type": "mllama", "vision_config": VISION_11B},  # text defaults: the 11B decoder
    "90b-vision": {"model_type": "mllama", "vision_config": VISION_11B,
                   "text_config": {"hidden_size": 8192, "num_hidden_layers": 100, "num_attention_heads": 64,
                                   "num_key_value_heads": 8, "intermediate_size": 28672,
                                   "cross_attention_layers": list(range(3, 100, 5))}},
}


def vision_config(name: str):
    """'90b-vision' -> its refimpl.model.vision_config.MllamaConfig (real shapes, for random weights)."""
    from refimpl.model.vision_config import MllamaConfig
    return MllamaConfig.from_hf(VISION_CONFIGS[name], source=name)


def model_config(key: str) -> LlamaConfig:
    """'1b' -> the Llama 3.2 1B config (real shapes; the benchmarks fill them with random weights)."""
    return PRESETS[MODELS[key]]


def decode_gemv_shapes(cfg: LlamaConfig) -> dict:
    """The decode step's GEMVs: name -> (N rows, K inputs, what the step fuses with it)."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (cfg.q_size + 2 * cfg.kv_size, D, "rope"), "o": (D, cfg.q_size, "residual"),
            "gate_up": (2 * F, D, "norm"), "down": (D, F, "swiglu"), "lm_head": (cfg.vocab_size, D, "norm")}


# ---- the command line and the results record ----

def model_keys(text: str) -> list[str]:
    """'1b,3b' -> ['1b', '3b']; an unknown name is an argparse error (one line, exit 2)."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    if not keys or any(k not in MODELS for k in keys):
        raise argparse.ArgumentTypeError(f"--models {text}: expected names of {', '.join(MODELS)}")
    return keys


def parser(script: str, doc: str, models: str | None = None, json_out: bool = True) -> argparse.ArgumentParser:
    """The parser every benchmark starts from: `python3 -m <script>` in the usage, the module docstring as the
    description, --json-out (the results record; sweeps write theirs into an output folder instead), and with
    `models` a --models list defaulting to it."""
    ap = argparse.ArgumentParser(prog=f"python3 -m {script}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if models is not None:
        ap.add_argument("--models", type=model_keys, default=model_keys(models),
                        help=f"comma-separated, of {', '.join(MODELS)} (default {models})")
    if json_out:
        ap.add_argument("--json-out", type=Path, default=None, help="also write the results record (JSON) here")
    return ap


def device_name(device: str = "cuda") -> str:
    """The GPU's name for a CUDA device, else the CPU's (with its core count)."""
    if str(device).startswith("cuda"):
        import torch
        return torch.cuda.get_device_name(device)
    import os
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def command_line(argv: list[str] | None = None) -> str:
    """How this process was started, as a user would type it again: `python3 -m tools.bench.gpu ...`."""
    argv = sys.argv if argv is None else argv
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = f"python3 -m {spec.name.removesuffix('.__main__')}" if spec else Path(argv[0]).name
    return " ".join([head, *argv[1:]])


def record(device: str = "cuda", command: str | None = None, **results) -> dict:
    """The results record every benchmark writes: the command that made it, the device, the date (UTC), the
    versions of torch and triton, then the results."""
    return {"command": command or command_line(), "device": device_name(device),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": version("torch"), "triton": version("triton"), **results}


def write_record(path: Path | None, rec: dict) -> None:
    """The record as indented JSON at `path` (nothing without one)."""
    if path is not None:
        Path(path).write_text(json.dumps(rec, indent=2, default=str) + "\n")


def require_cuda(script: str) -> None:
    """One error line, not a traceback, where a GPU-only benchmark starts without CUDA."""
    import torch
    if not torch.cuda.is_available():
        print(f"error: {script} needs a CUDA GPU (torch.cuda.is_available() is False here)", file=sys.stderr)
        raise SystemExit(2)


def require_gpus(ap: argparse.ArgumentParser, tp: int, script: str) -> None:
    """require_cuda, then `tp` GPUs for --tp (fewer: one argparse error line)."""
    require_cuda(script)
    import torch
    if torch.cuda.device_count() < tp:
        ap.error(f"--tp {tp} needs {tp} GPUs; this machine has {torch.cuda.device_count()}")


def table(columns: list[tuple[str, str]], rows: list[list]) -> list[str]:
    """A fixed-width table's lines, the header first: `columns` as (header, format spec such as '<14' or '>9.1f'),
    each row's cells in column order. The header and a str cell ('-' where a row has no value) take only the
    spec's alignment and width."""
    def cell(value, spec: str) -> str:
        return format(value, re.match(r"[<>^]?\d*", spec).group() if isinstance(value, str) else spec)
    return ["".join(cell(v, spec) for v, (_, spec) in zip(row, columns)) for row in [[h for h, _ in columns], *rows]]


# ---- timing ----

def median_ms(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median over `reps` of fn's time as called (CUDA events around each call), after `warmup` untimed calls."""
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def round_robin_ms(fns: dict, rounds: int = 9) -> dict:
    """{label: fn} called in turn, `rounds` times round-robin after one warm-up round -> {label: (median ms as
    called, CUDA events around one synced call; median ms the host took to queue it)}. Rows measured in turn share
    any drift of the host's speed, which sequential medians do not (one prefill as called differed by 30% between
    processes)."""
    import torch
    times = {label: ([], []) for label in fns}
    for r in range(rounds + 1):
        for label, fn in fns.items():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            fn()
            host = (time.perf_counter() - t) * 1e3
            end.record()
            end.synchronize()
            if r:
                times[label][0].append(start.elapsed_time(end))
                times[label][1].append(host)
    return {label: (statistics.median(c), statistics.median(h)) for label, (c, h) in times.items()}


def device_ms(fn, reps: int = 20, sleep_cycles: int = 40_000_000) -> float:
    """Device time of one fn() call, free of host launch cost: a ~20 ms spin kernel holds the stream while the
    host queues all `reps` calls, so the events between them see only the GPU's work. Median of 3. (Events around
    one eager call include the launch latency: 73 µs for a 3.4 µs decode-attention kernel.)"""
    import torch
    fn()  # outside the timing: cuBLAS handles, workspaces, Triton compilation
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[1]


def graph_us(calls, reps: int = 10, capture_error_mode: str = "global") -> float:
    """µs a call of `calls` captured in one CUDA graph (one call per weight copy: with >= 256 MB of copies the
    weights leave the L2 as a decode step's layers do), replayed `reps` times; the median, the graph's gaps
    between kernels included as in decode. capture_error_mode: torch.cuda.graph's ("thread_local" for NCCL
    collectives)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: compilation outside the capture
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode=capture_error_mode):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times)


def allreduce_us(split, D: int, layers: int, device) -> float:
    """µs an all-reduce of a [1, D] bf16 row (split.reduce: the decode step's) takes inside a CUDA graph of
    2·layers of them."""
    import torch
    x = torch.randn(1, D, device=device, dtype=torch.bfloat16)
    calls = [lambda: split.reduce(x)] * (2 * layers)
    return graph_us(calls, capture_error_mode="thread_local")


def cuda_profile(fn, rows: int):
    """fn() once under torch.profiler (CUDA activity), synchronised -> the top `rows` kernels by device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def profile_decode_steps(engine, sess, logits, pos: int, steps: int, rows: int) -> str:
    """Per-kernel device time of `steps` greedy decode steps of an eager (uncaptured) engine after its prefill
    (`logits` at `pos` tokens), after 4 warm-up steps (compilation): totals divided by `steps` are per token."""
    import torch
    engine.decode_greedy(sess, logits, pos, 4)
    torch.cuda.synchronize()
    return cuda_profile(lambda: engine.decode_greedy(sess, logits, pos, steps + 1), rows)


# ---- the device's ceilings and the engine at work ----

def copy_bandwidth(device, nbytes: int = 2**31, trials: int = 5) -> float:
    """Device-to-device copy, bytes read + written per second (TB/s), on a 2 GiB random buffer (>> the L2): the best
    of `trials` medians of 10 copies, each trial on buffers of its own. A single median has read 15% low minutes
    apart on the same GPU (a low reading raises every % of a roofline built on it); the best is what the memory
    reaches. The buffers are returned to the GPU after (the KV pools are sized from its free memory)."""
    import torch
    best = float("inf")
    for _ in range(trials):
        src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        best = min(best, median_ms(lambda: dst.copy_(src), reps=10, warmup=3))
        del src, dst
        torch.cuda.empty_cache()
    return 2 * nbytes / (best * 1e-3) / 1e12


def gemm_tflops(device, n: int = 8192) -> float:
    """bf16 n×n×n matrix product rate (TFLOP/s)."""
    import torch
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, reps=20, warmup=3)
    return 2 * n**3 / (ms * 1e-3) / 1e12


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


def hf_bf16_model(build, device, param_of):
    """build()'s HF model, made on the device in bf16 (the default dtype during the build), in eval mode, each
    parameter a copy of param_of(its name)."""
    import torch
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = build().eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(param_of(name))
    return model


def hf_llama(cfg: LlamaConfig, weights, device):
    """transformers' LlamaForCausalLM built on the device in bf16, holding copies of accel Weights' tensors."""
    import transformers

    from accel.weights import params_view
    views = params_view(weights, cfg)
    if cfg.tie_word_embeddings:
        views.setdefault("lm_head.weight", weights.lm_head)
    return hf_bf16_model(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf())), device,
                         views.__getitem__)
