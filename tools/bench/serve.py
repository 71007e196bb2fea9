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

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.bench.common import model_config, parser, record, require_cuda, version, write_record

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
RATES = "4,16,inf"
REQUESTS = 200
HF_ARGS = "--cb-use-cuda-graph --cb-max-memory-percent 0.6"  # its CUDA graphs, as batch.py runs HF
WARMUP, WARMUP_TOKENS = 64, 32  # untimed requests before the rates, and their max_tokens


def write_model_dir(cfg, out: Path, seed: int = 0, device: str = "cuda") -> Path:
    """config.json, model.safetensors (random bf16 at cfg's shapes), tokenizer.json: word i is 'w{i}'."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    from refimpl.formats.params import expected_shapes

    out.mkdir(parents=True, exist_ok=True)
    hf = cfg.to_hf()
    hf.update(bos_token_id=cfg.vocab_size - 3, eos_token_id=cfg.vocab_size - 1, torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()
        tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    words = {f"w{i}": i for i in range(cfg.vocab_size - len(SPECIALS))}
    words.update({s: cfg.vocab_size - len(SPECIALS) + i for i, s in enumerate(SPECIALS)})
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # no decoder: words joined with spaces, the fastest decode
    tok.add_special_tokens(SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIALS[0], "eos_token": SPECIALS[2], "tokenizer_class": "PreTrainedTokenizerFast"}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [cfg.vocab_size - 1]}))
    return out


def workload(n: int, vocab: int, seed: int, prompt=(32, 1024), output=(32, 512)) -> list[tuple[str, int, int]]:
    """n requests: (prompt text, prompt words, output tokens), lengths uniform in the closed ranges."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, o = int(rng.integers(prompt[0], prompt[1] + 1)), int(rng.integers(output[0], output[1] + 1))
        out.append((" ".join(f"w{i}" for i in rng.integers(0, vocab - len(SPECIALS), p)), p, o))
    return out


def length_range(text: str) -> tuple[int, int]:
    """'32-1024' -> (32, 1024)."""
    lo, sep, hi = text.partition("-")
    try:
        lo, hi = int(lo), int(hi)
    except ValueError:
        lo = hi = 0
    if not sep or lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"{text}: expected LOW-HIGH, 1 <= LOW <= HIGH")
    return lo, hi


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerFailed(Exception):
    """A server that exited or never answered /health: the message names it and ends with its log's last lines."""


def server_env() -> dict:
    """The servers' environment: offline (no update checks, no downloads), no NVLink multicast."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
            "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def log_tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no output)"


def start(name: str, cmd: list[str], port: int, log: Path, timeout: float = 600) -> subprocess.Popen:
    """Starts a server (its stdout and stderr into `log`) and polls its /health until it answers 200."""
    import httpx
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=server_env())
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise ServerFailed(f"{name} ({shlex.join(cmd)}) exited with status {proc.returncode} before answering "
                               f"/health; the end of {log}:\n{log_tail(log)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise ServerFailed(f"{name} did not answer /health within {timeout:.0f} s; the end of {log}:\n{log_tail(log)}")


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C (both servers drain and exit on it), then a kill after 10 s (transformers serve's process can
    linger after its server stopped)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion -> {"ttft", "tpot", "e2e" seconds, "tokens"} or {"error"}."""
    import httpx
    t0 = time.perf_counter()
    first, chunks, usage = None, 0, None
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return {"error": f"{r.status_code} {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": f"in the stream: {str(chunk['error'])[:200]}"}
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    chunks += 1
                    first = first or time.perf_counter()
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
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
    return {"rate": "inf" if rate == float("inf") else rate, "requests": len(reqs), "failed": len(reqs) - len(ok),
            "first_error": next((r["error"] for r in results if "error" in r), None), "wall_s": wall,
            "output_tokens": sum(r["tokens"] for r in ok), "max_tokens": sum(out for _, _, out in reqs),
            "output_tok_s": sum(r["tokens"] for r in ok) / wall, "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99), "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99)}


def bench_server(name: str, cmd: list[str], port: int, model: str, reqs, rates, seed: int, logs: Path) -> list:
    """One server started, warmed up, timed at each rate, stopped. The warm-up (untimed): the first WARMUP requests
    at once, each cut to WARMUP_TOKENS new tokens: the prompts' prefill shapes and the decode batch sizes up to
    WARMUP, compiled and captured before the clock starts."""
    proc = start(name, cmd, port, logs / f"{name}.log")
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        warm = [(text, p, min(o, WARMUP_TOKENS)) for text, p, o in reqs[:WARMUP]]
        asyncio.run(run_rate(url, model, warm, float("inf"), seed))
        rows = []
        for rate in rates:
            row = {"server": name, **asyncio.run(run_rate(url, model, reqs, rate, seed))}
            print(render_row(row), flush=True)
            rows.append(row)
            if proc.poll() is not None:  # died under load: the rates left are not run
                print(f"error: {name} exited with status {proc.returncode} during the run; the end of its log:\n"
                      f"{log_tail(logs / f'{name}.log')}", file=sys.stderr, flush=True)
                rows.append({"server": name, "error": f"exited with status {proc.returncode} at rate {rate}"})
                break
        return rows
    finally:
        stop(proc)


def render_row(row: dict) -> str:
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    return (f"{row['server']:>9} rate {row['rate']:>6}: {row['output_tok_s']:8.1f} tok/s  TTFT p50/p99 "
            f"{f(row['ttft_p50_ms'], '.0f')}/{f(row['ttft_p99_ms'], '.0f')} ms  TPOT p50/p99 "
            f"{f(row['tpot_p50_ms'], '.1f')}/{f(row['tpot_p99_ms'], '.1f')} ms  failed {row['failed']}"
            + (f" ({row['first_error']})" if row["first_error"] else ""))


def server_commands(model_dir: Path, name: str, device: str, hf_args: list[str]) -> dict[str, tuple[list, str]]:
    """Each server's command line and the model name its requests carry. Both bind 127.0.0.1 on a free port
    ({port} in the commands); both run bf16 on a GPU, fp32 on CPU."""
    gpu = device.startswith("cuda")
    ours = [sys.executable, "-m", "tools.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
            "--port", "{port}", "--served-model-name", name, "--device", device, "--dtype", "bf16" if gpu else "fp32"]
    hf = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir), "--continuous-batching",
          "--host", "127.0.0.1", "--port", "{port}", "--device", device, "--dtype", "bfloat16" if gpu else "float32",
          *hf_args]
    return {"llama32": (ours, name), "hf-serve": (hf, str(model_dir))}


def bench_model(key: str, cfg, args, workdir: Path) -> list[dict]:
    """Both servers (or one, with --skip-hf or --skip-ours) on one model's checkpoint, the same requests and arrivals.
    A server that cannot start is reported (its log's tail) and recorded as an error row; the other still runs."""
    model_dir = write_model_dir(cfg, workdir / key, args.seed, args.device)
    reqs = workload(args.requests, cfg.vocab_size, args.seed, args.prompt_lengths, args.output_lengths)
    rows = []
    for name, (cmd, model) in server_commands(model_dir, key, args.device, shlex.split(args.hf_args)).items():
        if args.skip_hf if name == "hf-serve" else args.skip_ours:
            continue
        port = free_port()
        cmd = [c.replace("{port}", str(port)) for c in cmd]
        try:
            rows += [{"model": key, **r} for r in bench_server(name, cmd, port, model, reqs, args.rates, args.seed,
                                                              workdir)]
        except ServerFailed as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            rows.append({"model": key, "server": name, "error": str(e).splitlines()[0]})
    return rows


def rates_arg(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"--rates {text}: expected positive numbers or inf, comma-separated")
    return rates


def arg_parser():
    ap = parser("tools.bench.serve", __doc__, models="1b")
    ap.add_argument("--rates", type=rates_arg, default=rates_arg(RATES),
                    help=f"request rates per second, comma-separated (inf: all at once; default {RATES})")
    ap.add_argument("--requests", type=int, default=REQUESTS, help=f"requests per rate (default {REQUESTS})")
    ap.add_argument("--prompt-lengths", type=length_range, default=(32, 1024), metavar="LOW-HIGH",
                    help="prompt words (one token each), uniform (default 32-1024)")
    ap.add_argument("--output-lengths", type=length_range, default=(32, 512), metavar="LOW-HIGH",
                    help="max_tokens of each request, uniform (default 32-512)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true", help="llama32 serve alone")
    ap.add_argument("--skip-ours", action="store_true", help="transformers serve alone")
    ap.add_argument("--hf-args", default=HF_ARGS,
                    help=f"extra arguments of `transformers serve` (default {HF_ARGS!r})")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a check of its logic)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the checkpoint and server logs go")
    return ap


def main(argv=None, configs: dict | None = None):
    """`configs` (tests): {name: LlamaConfig} in place of --models."""
    ap = arg_parser()
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error("--requests must be >= 1")
    if args.device.startswith("cuda"):
        require_cuda("python3 -m tools.bench.serve")
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed (a time limit): servers stopped
    try:
        return run(args, configs)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args, configs: dict | None = None, command: str | None = None) -> dict:
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="llama32-serve-bench-"))
    configs = configs or {key: model_config(key) for key in args.models}
    rows = []
    for key, cfg in configs.items():
        print(f"benchmarking serving, {key}: {args.requests} requests at rates {args.rates} ...", flush=True)
        rows += bench_model(key, cfg, args, workdir)
    rec = record(args.device, command=command, requests=args.requests, rates=[str(r) for r in args.rates],
                 hf_args=args.hf_args, transformers=version("transformers"), rows=rows, against_hf=against_hf(rows))
    print(render(rec), flush=True)
    write_record(args.json_out, rec)
    return rec


def against_hf(rows: list[dict]) -> list[dict]:
    """Per model and rate both servers ran without failures: ours over HF's output tok/s, and our TPOT p99 over
    HF's (the targets: saturated throughput >= 5x, TPOT p99 <= 1/3 at equal rates)."""
    ok = {(r["model"], r["server"], r["rate"]): r for r in rows if "error" not in r and not r["failed"]}
    out = []
    for (model, server, rate), ours in ok.items():
        hf = ok.get((model, "hf-serve", rate))
        if server == "llama32" and hf is not None:
            tpot = (ours["tpot_p99_ms"] / hf["tpot_p99_ms"]) if ours["tpot_p99_ms"] and hf["tpot_p99_ms"] else None
            out.append({"model": model, "rate": rate, "throughput_x": ours["output_tok_s"] / hf["output_tok_s"],
                        "tpot_p99_ratio": tpot})
    return out


def render(rec: dict) -> str:
    lines = [f"serving — {rec['device']} — {rec['date']} — {rec['requests']} requests per rate", ""]
    lines += [f"{r['server']:>9}: {r['error']}" if "error" in r else render_row(r) for r in rec["rows"]]
    lines += [f"{c['model']} rate {c['rate']}: ours x{c['throughput_x']:.1f} HF's output tok/s, TPOT p99 "
              + ("-" if c["tpot_p99_ratio"] is None else f"{c['tpot_p99_ratio']:.2f}") + " of HF's"
              for c in rec.get("against_hf", [])]
    lines.append("(completions streamed, temperature 0; TTFT: request sent to first text; TPOT: the rest of the "
                 "stream over the tokens after the first; tok/s: output tokens over the rate's wall time)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
