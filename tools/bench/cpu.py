"""CPU decode benchmark: the NumPy refimpl against HF transformers (eager attention) on the same GGUF weights.

    python -m tools.bench.cpu                       # default model (SmolLM2-135M-Instruct Q4_1), 64 new tokens
    python -m tools.bench.cpu --profile --json-out out.json
    python -m tools.bench.cpu --random              # random fp32 weights at SmolLM2-135M's shapes

The engines (refimpl, HF eager fp32, and accel's torch path on CPU in fp32 when torch is installed) run greedy from the
same chat prompt for a fixed number of tokens (no stop ids), in one process, one after the other. The record names the
machine's state: CPUs, 1-minute load average before and after, OpenBLAS's core type and threads, torch's threads;
JSON is written only with --json-out. Decode speed is (tokens - 1) / (time of the last token - time of the first): the
prefill and the first token are left out. `--profile` also times each op of the refimpl's one-token forward (summed
over the decode), to show where a decode step goes. A benchmark, not a test: it asserts nothing.
"""
from __future__ import annotations

import os

# Same BLAS setting as the `llama32` CLI (tools/cli/__init__.py): one OpenBLAS thread, set before NumPy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from refimpl.model import ops  # noqa: E402
from refimpl.formats.checkpoint import load_checkpoint  # noqa: E402
from refimpl.generate import RefEngine, Sampling  # noqa: E402
from refimpl.model.llama import KVCache, forward  # noqa: E402
from tools.bench import common  # noqa: E402


def decode_rate(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def cpu_ms_per_token(cpu_stamps: list[float]) -> float:
    """Process CPU time (all threads) per decoded token: on a shared machine, the part of the cost that other
    processes' load does not stretch (for a one-thread engine; a two-thread one counts both threads)."""
    return 1000 * (cpu_stamps[-1] - cpu_stamps[0]) / (len(cpu_stamps) - 1)


def time_engine(engine, prompt_ids: list[int], new_tokens: int, runs: int) -> dict:
    """Greedy decode of `new_tokens` after one warm-up (pages in weights, BLAS buffers), `runs` times."""
    list(engine.generate(prompt_ids, Sampling(max_new_tokens=4)))
    rates, cpu_ms, tokens = [], [], None
    for _ in range(runs):
        t0, stamps, cpus, out = time.perf_counter(), [], [], []
        for token in engine.generate(prompt_ids, Sampling(max_new_tokens=new_tokens)):
            stamps.append(time.perf_counter())
            cpus.append(time.process_time())
            out.append(token)
        rates.append(decode_rate(stamps))
        cpu_ms.append(cpu_ms_per_token(cpus))
        tokens = out
    return {"decode_tok_s": statistics.median(rates), "runs_tok_s": rates, "prefill_s": stamps[0] - t0,
            "cpu_ms_per_token": statistics.median(cpu_ms), "tokens": tokens}


def bench_refimpl(ckpt, prompt_ids: list[int], new_tokens: int, runs: int) -> dict:
    return time_engine(RefEngine(ckpt), prompt_ids, new_tokens, runs)


def bench_hf(path: Path, gguf: bool, prompt_ids: list[int], new_tokens: int, threads: int, runs: int) -> dict:
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(threads)

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times, self.cpus = [], []

        def put(self, value):  # first call: the prompt; then one call per new token
            self.times.append(time.perf_counter())
            self.cpus.append(time.process_time())

        def end(self):
            pass

    where = dict(pretrained_model_name_or_path=path.parent, gguf_file=path.name) if gguf else \
        dict(pretrained_model_name_or_path=path)
    model = transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    ids = torch.tensor([prompt_ids])
    kw = dict(do_sample=False, pad_token_id=0)
    rates, cpu_ms, tokens = [], [], None
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        for _ in range(runs):
            streamer = Stamps()
            # min_new_tokens: a fixed count, as the refimpl runs without stop ids (`same_tokens` shows whether
            # suppressing eos changed anything)
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=streamer, **kw)
            rates.append(decode_rate(streamer.times[1:]))
            cpu_ms.append(cpu_ms_per_token(streamer.cpus[1:]))
            tokens = out[0, len(prompt_ids):].tolist()
    return {"decode_tok_s": statistics.median(rates), "runs_tok_s": rates, "threads": threads,
            "cpu_ms_per_token": statistics.median(cpu_ms), "tokens": tokens}


def bench_accel_cpu(ckpt, prompt_ids: list[int], new_tokens: int, threads: int, runs: int) -> dict:
    """accel on CPU in fp32 (torch kernels; Triton runs on GPUs only, outside its interpreter)."""
    import torch

    from accel.engine import AccelEngine
    torch.set_num_threads(threads)
    engine = AccelEngine.from_checkpoint(ckpt, device="cpu", dtype="fp32")
    return {**time_engine(engine, prompt_ids, new_tokens, runs), "threads": threads}


def openblas_core() -> str | None:
    """The core type OpenBLAS picked (or was told by OPENBLAS_CORETYPE), asked from NumPy's own OpenBLAS."""
    import ctypes
    import glob
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*"))
    for lib in libs:
        cdll = ctypes.CDLL(lib)
        for symbol in ("scipy_openblas_get_corename64_", "openblas_get_corename64_", "openblas_get_corename"):
            fn = getattr(cdll, symbol, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return fn().decode()
    return None


class TimedOps:
    """refimpl.model.ops with each call timed; linear calls are split by output width (the lm_head is one of them)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __getattr__(self, name):
        fn = getattr(ops, name)

        def timed(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            key = f"linear[{args[1].shape[0]}x{args[1].shape[1]}]" if name == "linear" else name
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0
            return out
        return timed


def profile_decode(ckpt, prompt_ids: list[int], new_tokens: int) -> dict:
    """Per-op seconds per decoded token over a greedy decode, plus the time outside the ops."""
    cfg, params = ckpt.config, ckpt.params
    cache = KVCache.allocate(cfg, len(prompt_ids) + new_tokens, lambda shape: np.zeros(shape, np.float32))
    logits = forward(ops, params, cfg, np.array(prompt_ids), np.arange(len(prompt_ids)), cache, True)
    timed, pos = TimedOps(), len(prompt_ids)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        token = int(np.argmax(logits[-1]))
        logits = forward(timed, params, cfg, np.array([token]), np.array([pos]), cache, True)
        pos += 1
    total = time.perf_counter() - t0
    per_token = {k: v / new_tokens for k, v in sorted(timed.seconds.items(), key=lambda kv: -kv[1])}
    per_token["(outside ops)"] = total / new_tokens - sum(per_token.values())
    return {"step_ms": 1000 * total / new_tokens, "ms_per_token": {k: 1000 * v for k, v in per_token.items()}}


def main(argv=None) -> int:
    ap = common.parser("tools.bench.cpu", __doc__)
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: SmolLM2-135M-Instruct, fetched)")
    ap.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per engine (median reported)")
    ap.add_argument("--hf-threads", type=int, default=2, help="torch threads for HF (the machine's 2 cores)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also time each refimpl op in a decode step")
    ap.add_argument("--random", action="store_true",
                    help="random fp32 weights at SmolLM2-135M's shapes instead of the GGUF (32 random prompt ids)")
    ap.add_argument("--skip-accel", action="store_true", help="skip accel on CPU (fp32, torch kernels)")
    args = ap.parse_args(argv)

    if args.random:
        import tempfile

        from refimpl.formats.checkpoint import save_checkpoint

        from refimpl.formats.params import random_params
        from refimpl.model.config import PRESETS
        cfg = PRESETS["smollm2-135m"]
        args.model = save_checkpoint(Path(tempfile.mkdtemp()) / "smollm2-135m-random", cfg, random_params(cfg))
    elif args.model is None:
        from tools.default_model import default_model_path
        args.model = default_model_path(fetch_if_missing=True)
    t0 = time.perf_counter()
    ckpt = load_checkpoint(args.model, with_tokenizer=not args.random)
    load_s = time.perf_counter() - t0
    if args.random:
        prompt_ids = np.random.default_rng(0).integers(0, ckpt.config.vocab_size, 32).tolist()
    else:
        prompt_ids = ckpt.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    record = common.record("cpu", **{
        "model": str(args.model), "prompt_tokens": len(prompt_ids), "new_tokens": args.new_tokens,
        "machine": {"cpus": len(os.sched_getaffinity(0)), "processor": platform.processor() or platform.machine(),
                    "load_avg_1min": os.getloadavg()[0], "numpy": np.__version__,
                    "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"), "openblas_core": openblas_core(),
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())},
        "refimpl": {"load_s": load_s, **bench_refimpl(ckpt, prompt_ids, args.new_tokens, args.runs)},
    })
    if not args.skip_hf:
        import transformers
        hf = bench_hf(args.model, not args.random, prompt_ids, args.new_tokens, args.hf_threads, args.runs)
        record["hf_eager"] = {"transformers": transformers.__version__, **hf}
        record["same_tokens"] = record["hf_eager"]["tokens"] == record["refimpl"]["tokens"]
    if not args.skip_accel:
        try:
            import torch  # noqa: F401
        except ImportError:
            args.skip_accel = True
    if not args.skip_accel:
        record["accel_cpu_fp32"] = bench_accel_cpu(ckpt, prompt_ids, args.new_tokens, args.hf_threads, args.runs)
        record["accel_same_tokens"] = record["accel_cpu_fp32"]["tokens"] == record["refimpl"]["tokens"]
    if args.profile:
        record["refimpl_profile"] = profile_decode(ckpt, prompt_ids, args.new_tokens)
    record["machine"]["load_avg_1min_after"] = os.getloadavg()[0]

    m = record["machine"]
    print(f"{Path(args.model).name}: {len(prompt_ids)} prompt tokens, {args.new_tokens} new tokens, greedy, "
          f"{m['cpus']} CPUs (1-min load {m['load_avg_1min']:.1f} -> {m['load_avg_1min_after']:.1f}), "
          f"OpenBLAS core {m['openblas_core']}, {m['openblas_threads']} BLAS thread(s)")
    print(f"{'engine':<26}{'decode tok/s':>14}{'CPU ms/token':>14}{'runs':>28}")
    rows = [("refimpl (NumPy fp32)", record["refimpl"])]
    if "hf_eager" in record:
        rows.append((f"HF eager fp32, {args.hf_threads} threads", record["hf_eager"]))
    if "accel_cpu_fp32" in record:
        rows.append((f"accel CPU fp32, {args.hf_threads} thr", record["accel_cpu_fp32"]))
    for label, r in rows:
        print(f"{label:<26}{r['decode_tok_s']:>14.1f}{r['cpu_ms_per_token']:>14.1f}"
              f"{', '.join(f'{x:.1f}' for x in r['runs_tok_s']):>28}")
    if "same_tokens" in record:
        print(f"identical greedy tokens (HF vs refimpl): {record['same_tokens']}")
    if "accel_same_tokens" in record:
        print(f"identical greedy tokens (accel vs refimpl): {record['accel_same_tokens']}")
    if "hf_eager" in record:
        print(f"refimpl / HF: {record['refimpl']['decode_tok_s'] / record['hf_eager']['decode_tok_s']:.2f}x")
    if args.profile:
        p = record["refimpl_profile"]
        print(f"\nrefimpl decode step: {p['step_ms']:.1f} ms/token")
        for name, ms in p["ms_per_token"].items():
            print(f"  {name:<24}{ms:8.2f} ms  {100 * ms / p['step_ms']:5.1f} %")
    common.write_record(args.json_out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
