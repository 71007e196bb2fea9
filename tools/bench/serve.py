"""Serving benchmark: `llama32 serve` against HF's `transformers serve --continuous-batching`, the same requests
on the same GPU in one run, under Poisson arrivals at several request rates.

A checkpoint directory at the Llama 3.2 shape is written first (random bf16 weights, and a word-level tokenizer
covering the whole vocabulary, so that every id either server samples decodes to text). The workload: prompt
lengths 32-1024 and output lengths 32-512 drawn from a fixed seed (the batched engine's workload); each request
streams a completion with temperature 0 and max_tokens = its output length. Per rate and server: output tokens/s,
time to first token (TTFT) and time per output token after the first (TPOT), p50 and p99 — vLLM's
benchmark_serving metrics. Targets: at equal request rate TPOT p99 <= 1/3 of HF's; saturated throughput >= 5x HF's.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.bench.common import model_config, parser, record, require_cuda, write_record

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def write_model_dir(cfg, out: Path, seed: int = 0) -> Path:
    """config.json, model.safetensors (random bf16 at cfg's shapes), tokenizer.json: word i is 'w{i}'."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from refimpl.formats.params import expected_shapes

    out.mkdir(parents=True, exist_ok=True)
    hf = cfg.to_hf()
    hf.update(bos_token_id=cfg.vocab_size - 3, eos_token_id=cfg.vocab_size - 1, torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16, device="cuda")
        else:
            t = (torch.randn(shape, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
        tensors[name] = t.cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    words = {f"w{i}": i for i in range(cfg.vocab_size - len(SPECIALS))}
    words.update({s: cfg.vocab_size - len(SPECIALS) + i for i, s in enumerate(SPECIALS)})
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIALS[0], "eos_token": SPECIALS[2], "tokenizer_class": "PreTrainedTokenizerFast"}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [cfg.vocab_size - 1]}))
    return out


def workload(n: int, vocab: int, seed: int) -> list[tuple[str, int, int]]:
    """n requests: (prompt text, prompt words, output tokens), lengths as the batched engine's workload."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, o = int(rng.integers(32, 1025)), int(rng.integers(32, 513))
        out.append((" ".join(f"w{i}" for i in rng.integers(0, vocab - len(SPECIALS), p)), p, o))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, log: Path, timeout: float = 600) -> subprocess.Popen:
    import httpx
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: {cmd[0]} {cmd[1]} exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"error: {cmd[0]} {cmd[1]} did not answer /health within {timeout:.0f} s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, chunks, usage = None, 0, None
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code} {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                chunks += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else chunks
    return {"ttft": (first or end) - t0, "e2e": end - t0, "tokens": tokens,
            "tpot": (end - first) / (tokens - 1) if first and tokens > 1 else None}


async def run_rate(url: str, model: str, reqs, rate: float, seed: int) -> dict:
    import httpx
    rng = np.random.default_rng(seed)
    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for prompt, _, out in reqs:
            tasks.append(asyncio.ensure_future(one_request(client, url, model, prompt, out)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1 / rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    pct = lambda xs, q: float(np.percentile(xs, q) * 1e3) if xs else None  # noqa: E731
    ttft, tpot = [r["ttft"] for r in ok], [r["tpot"] for r in ok if r["tpot"] is not None]
    return {"rate": rate, "requests": len(reqs), "failed": len(reqs) - len(ok),
            "first_error": next((r["error"] for r in results if "error" in r), None), "wall_s": wall,
            "output_tok_s": sum(r["tokens"] for r in ok) / wall, "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99), "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99)}


def bench_server(name: str, cmd: list[str], port: int, model: str, reqs, rates, seed: int, logs: Path) -> list:
    proc = start(cmd, port, logs / f"{name}.log")
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        asyncio.run(run_rate(url, model, reqs[:8], float("inf"), seed))  # warm-up: compilation, graphs
        rows = []
        for rate in rates:
            row = {"server": name, **asyncio.run(run_rate(url, model, reqs, rate, seed))}
            print(f"{name:>12} rate {rate:>6}: {row['output_tok_s']:8.1f} tok/s  TTFT p50/p99 "
                  f"{row['ttft_p50_ms']:.0f}/{row['ttft_p99_ms']:.0f} ms  TPOT p50/p99 {row['tpot_p50_ms']:.1f}/"
                  f"{row['tpot_p99_ms']:.1f} ms  failed {row['failed']}", flush=True)
            rows.append(row)
        return rows
    finally:
        stop(proc)


def main(argv=None):
    ap = parser("tools.bench.serve", __doc__, models="1b")
    ap.add_argument("--rates", default="2,8,inf", help="request rates per second, comma-separated (inf: all at once)")
    ap.add_argument("--requests", type=int, default=200, help="requests per rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true", help="llama32 serve alone")
    ap.add_argument("--workdir", type=Path, default=None, help="where the checkpoint and server logs go")
    args = ap.parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        ap.error(f"--rates {args.rates}: expected numbers or inf, comma-separated")
    if args.requests < 1:
        ap.error("--requests must be >= 1")
    require_cuda("python3 -m tools.bench.serve")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="llama32-serve-bench-"))
    results = []
    for key in args.models:
        cfg = model_config(key)
        model_dir = write_model_dir(cfg, workdir / key, args.seed)
        reqs = workload(args.requests, cfg.vocab_size, args.seed)
        port = free_port()
        ours = [sys.executable, "-m", "tools.cli", "serve", "--model", str(model_dir), "--port", str(port),
                "--served-model-name", key]
        results += [{"model": key, **r} for r in bench_server("llama32", ours, port, key, reqs, rates, args.seed,
                                                              workdir)]
        if not args.skip_hf:
            port = free_port()
            hf = ["transformers", "serve", str(model_dir), "--continuous-batching", "--port", str(port), "--host",
                  "127.0.0.1", "--dtype", "bfloat16"]
            results += [{"model": key, **r} for r in bench_server("hf-serve", hf, port, str(model_dir), reqs, rates,
                                                                  args.seed, workdir)]
    write_record(args.json_out, record(rows=results))
    return results


if __name__ == "__main__":
    main()
