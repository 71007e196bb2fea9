"""CPU decode benchmark: the NumPy refimpl against HF transformers (eager attention) on the same GGUF weights.

    python -m tools.bench.cpu                       # default model (SmolLM2-135M-Instruct Q4_1), 64 new tokens
    python -m tools.bench.cpu --profile --json out.json
    python -m tools.bench.cpu --random              # random fp32 weights at SmolLM2-135M's shapes

Both engines run greedy from the same chat prompt for a fixed number of tokens (no stop ids), in one process, one
after the other. Decode speed is (tokens - 1) / (time of the last token - time of the first): the prefill and the
first token are left out. `--profile` also times each op of the refimpl's one-token forward (summed over the
decode), to show where a decode step goes. A benchmark, not a test: it asserts nothing.
"""
from __future__ import annotations

import os

# Same BLAS setting as the `llama32` CLI (tools/cli/__init__.py): one OpenBLAS thread, set before NumPy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
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


def decode_rate(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def bench_refimpl(ckpt, prompt_ids: list[int], new_tokens: int, runs: int) -> dict:
    engine = RefEngine(ckpt)
    list(engine.generate(prompt_ids, Sampling(max_new_tokens=4)))  # warm-up: page in weights, BLAS buffers
    rates, tokens = [], None
    for _ in range(runs):
        t0, stamps, out = time.perf_counter(), [], []
        for token in engine.generate(prompt_ids, Sampling(max_new_tokens=new_tokens)):
            stamps.append(time.perf_counter())
            out.append(token)
        rates.append(decode_rate(stamps))
        tokens = out
    return {"decode_tok_s": statistics.median(rates), "runs_tok_s": rates, "prefill_s": stamps[0] - t0,
            "tokens": tokens}


def bench_hf(path: Path, gguf: bool, prompt_ids: list[int], new_tokens: int, threads: int, runs: int) -> dict:
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(threads)

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):  # first call: the prompt; then one call per new token
            self.times.append(time.perf_counter())

        def end(self):
            pass

    where = dict(pretrained_model_name_or_path=path.parent, gguf_file=path.name) if gguf else \
        dict(pretrained_model_name_or_path=path)
    model = transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    ids = torch.tensor([prompt_ids])
    kw = dict(do_sample=False, pad_token_id=0)
    rates, tokens = [], None
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        for _ in range(runs):
            streamer = Stamps()
            # min_new_tokens: a fixed count, as the refimpl runs without stop ids (`same_tokens` shows whether
            # suppressing eos changed anything)
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=streamer, **kw)
            rates.append(decode_rate(streamer.times[1:]))
            tokens = out[0, len(prompt_ids):].tolist()
    return {"decode_tok_s": statistics.median(rates), "runs_tok_s": rates, "threads": threads, "tokens": tokens}


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: SmolLM2-135M-Instruct, fetched)")
    ap.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per engine (median reported)")
    ap.add_argument("--hf-threads", type=int, default=2, help="torch threads for HF (the machine's 2 cores)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also time each refimpl op in a decode step")
    ap.add_argument("--random", action="store_true",
                    help="random fp32 weights at SmolLM2-135M's shapes instead of the GGUF (32 random prompt ids)")
    ap.add_argument("--json", type=Path, default=Path("bench_cpu.json"))
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
    record = {
        "model": str(args.model), "prompt_tokens": len(prompt_ids), "new_tokens": args.new_tokens,
        "machine": {"cpus": len(os.sched_getaffinity(0)), "processor": platform.processor() or platform.machine(),
                    "load_avg_1min": os.getloadavg()[0], "numpy": np.__version__,
                    "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS")},
        "refimpl": {"load_s": load_s, **bench_refimpl(ckpt, prompt_ids, args.new_tokens, args.runs)},
    }
    if not args.skip_hf:
        import transformers
        hf = bench_hf(args.model, not args.random, prompt_ids, args.new_tokens, args.hf_threads, args.runs)
        record["hf_eager"] = {"transformers": transformers.__version__, **hf}
        record["same_tokens"] = record["hf_eager"]["tokens"] == record["refimpl"]["tokens"]
    if args.profile:
        record["refimpl_profile"] = profile_decode(ckpt, prompt_ids, args.new_tokens)

    print(f"{Path(args.model).name}: {len(prompt_ids)} prompt tokens, {args.new_tokens} new tokens, greedy, "
          f"{record['machine']['cpus']} CPUs (1-min load {record['machine']['load_avg_1min']:.1f})")
    print(f"{'engine':<26}{'decode tok/s':>14}{'runs':>28}")
    rows = [("refimpl (NumPy fp32)", record["refimpl"])]
    if "hf_eager" in record:
        rows.append((f"HF eager fp32, {args.hf_threads} threads", record["hf_eager"]))
    for label, r in rows:
        print(f"{label:<26}{r['decode_tok_s']:>14.1f}{', '.join(f'{x:.1f}' for x in r['runs_tok_s']):>28}")
    if "same_tokens" in record:
        print(f"identical greedy tokens: {record['same_tokens']}")
    if args.profile:
        p = record["refimpl_profile"]
        print(f"\nrefimpl decode step: {p['step_ms']:.1f} ms/token")
        for name, ms in p["ms_per_token"].items():
            print(f"  {name:<24}{ms:8.2f} ms  {100 * ms / p['step_ms']:5.1f} %")
    args.json.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
