"""`llama32 bench`: the accel engine at the real Llama 3.2 1B/3B shapes on random bf16 weights.

Prints one table (device name and date on top) and writes the same numbers as JSON with --json-out (the record
of tools.bench.common: command, device, date, versions). The measurements live in tools/bench/ (gpu, quant_gpu,
vision, train), which is part of a checkout, not of the installed package; this module only picks the parts and
formats them.
"""
from __future__ import annotations

import importlib.util
import shlex
import sys

import click

from refimpl.errors import GenerationError

from tools.cli.options import Count, UserPath
from tools.tp import TP_OPTION

VISION_MODELS = ("11b-vision", "90b-vision")  # 11b: measured; 90b: its memory need against this GPU


def _bench_args(argv: list[str]) -> list[str]:
    """The arguments after `bench` in this process's command line (global options such as --debug come before)."""
    return argv[argv.index("bench") + 1:] if "bench" in argv else argv[1:]


def _benchmarks():
    """tools.bench.common, or one error line where the package was installed without the benchmarks."""
    try:
        from tools.bench import common
    except ModuleNotFoundError as e:
        if e.name not in ("tools.bench", "tools.bench.common"):
            raise
        raise GenerationError("llama32 bench runs from a checkout of the repository (tools/bench is not installed "
                              "with the package): cd into a checkout, `pip install -e .`, and run it there") from None
    return common


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def render(result: dict) -> str:
    lines = [f"llama32 bench — {result['device']} — {result['date']}",
             f"ceilings: copy {result['copy_tb_s']:.2f} TB/s (read+write), bf16 GEMM 8192^3 "
             f"{result['gemm_tflop_s']:.0f} TFLOP/s", ""]
    if result["models"]:
        lines.append(f"{'model':<14}{'decode tok/s':>13}{'roofline':>10}{'% roof':>8}{'torch-ops':>10}"
                     f"{'HF tok/s':>10}{'x HF':>7}{'prefill ms':>12}{'GPU ms':>8}{'TFLOP/s':>9}{'peak GB':>9}")
        for r in result["models"]:
            lines.append(f"{r['model']:<14}{r['decode_tok_s']:>13.1f}{_fmt(r.get('roofline_tok_s')):>10}"
                         f"{_fmt(r.get('roofline_pct')):>8}{r['decode_tok_s_torch_ops']:>10.1f}"
                         f"{_fmt(r.get('hf_tok_s')):>10}{_fmt(r.get('speedup_vs_hf')):>7}"
                         f"{r['prefill_ms']:>12.2f}{r['prefill_gpu_ms']:>8.2f}{r['prefill_tflop_s']:>9.0f}"
                         f"{r['peak_gpu_mem_gb']:>9.2f}")
        lines.append("(decode: batch 1, 32-token prompt, 256 greedy tokens, one CUDA graph a step; torch-ops: the "
                     "same engine with plain torch ops instead of the Triton kernels; prefill: "
                     f"{result['models'][0]['prefill_tokens']} tokens, as called (host launch cost included) and "
                     "GPU time alone; TFLOP/s of the former)")
    if result.get("attention"):
        lines += ["", f"{'attention fwd (causal, GQA 8 kv)':<34}{'triton ms':>10}{'SDPA ms':>9}{'triton TF/s':>12}"
                      f"{'SDPA TF/s':>10}{'ratio':>7}{'rel err':>9}"]
        for a in result["attention"]:
            lines.append(f"{'S=%d H=%d E=%d' % (a['S'], a['H'], a['E']):<34}{a['triton_ms']:>10.3f}"
                         f"{a['sdpa_ms']:>9.3f}{a['triton_tflop_s']:>12.0f}{a['sdpa_tflop_s']:>10.0f}"
                         f"{a['ratio_triton_over_sdpa']:>7.2f}{a['rel_err_vs_sdpa']:>9.1e}")
    if result.get("decode_attention"):
        lines += ["", f"{'decode attention (H=32 K=8 E=64)':<34}{'in step us':>10}{'SDPA us':>9}{'TB/s':>12}"
                      f"{'rel err':>17}{'alone us':>10}"]
        for a in result["decode_attention"]:
            lines.append(f"{'context %d' % a['context']:<34}{a['in_step_us']:>10.1f}{a['sdpa_us']:>9.1f}"
                         f"{a['in_step_tb_s']:>12.2f}{a['rel_err_vs_sdpa']:>17.1e}{_fmt(a.get('alone_us'), '.1f'):>10}")
        lines.append("(in step: as the decode step runs it, PDL-launched behind qkv_rope, the pair's device time "
                     "minus qkv_rope's; alone: back-to-back launches of the kernel by itself)")
    if result.get("vision"):
        lines += ["", f"{'vision model':<14}{'encode ms':>10}{'x GEMM':>8}{'prefill ms':>11}{'decode tok/s':>13}"
                      f"{'roofline':>10}{'% roof':>8}{'HF tok/s':>10}{'x HF':>7}{'peak GB':>9}"]
        for r in result["vision"]:
            lines.append(f"{r['model']:<14}{r['encode_ms']:>10.1f}{_fmt(r.get('encode_over_gemm_time'), '.2f'):>8}"
                         f"{r['prefill_ms']:>11.1f}{r['decode_tok_s']:>13.1f}{_fmt(r.get('roofline_tok_s')):>10}"
                         f"{_fmt(r.get('roofline_pct')):>8}{_fmt(r.get('hf_decode_tok_s')):>10}"
                         f"{_fmt(r.get('speedup_vs_hf')):>7}{r['peak_gpu_mem_gb']:>9.2f}")
        r = result["vision"][0]
        lines.append(f"(encode: {r['tiles']} tiles of one image, encoder + projector + the image K/V of every cross "
                     f"layer; x GEMM: that time over its {r['encode_tflop']:.1f} TFLOP at the bf16 GEMM rate; prefill: "
                     f"{r['prompt_tokens']} tokens with the image in the cache; decode: {r['new_tokens']} greedy "
                     f"tokens, one CUDA graph a step; HF: eager generate, its encode and prefill subtracted)")
    for f in result.get("vision_memory", []):
        lines.append(f"{f['model']}: bf16 weights {f['weights_gb']:.1f} GB + KV for {f['context']} positions "
                     f"{f['kv_gb']:.2f} GB + image K/V {f['image_kv_gb']:.2f} GB = {f['total_gb']:.1f} GB; this GPU "
                     f"has {f['gpu_gb']:.1f} GB: "
                     f"{'fits on one GPU' if f['fits_one_gpu'] else 'does NOT fit on one GPU'}")
    return "\n".join(lines)


def _tp_bench(models: list[str], tp: int, new_tokens: int, json_out, **unsupported) -> None:
    """tools.bench.tp: batch-1 decode at TP=1 and TP=tp in one run. unsupported: the options it does not take, by
    flag name -> value given."""
    import torch
    given = [flag for flag, value in unsupported.items() if value]
    if given:
        raise GenerationError(f"--tp {tp} benchmarks batch-1 decode of the text models for now; drop {given[0]}")
    if torch.cuda.device_count() < tp:
        raise GenerationError(f"--tp {tp} needs {tp} GPUs; this machine has {torch.cuda.device_count()}")
    from tools.bench import tp as tp_bench
    args = tp_bench.arg_parser().parse_args([])
    args.models, args.tp, args.new_tokens, args.json_out = models, tp, max(new_tokens, 2), json_out
    tp_bench.run(args, command=shlex.join(["llama32", "bench", *_bench_args(sys.argv)]))


def _batch_bench(models: list[str], device: str, skip_hf: bool, json_out) -> None:
    """tools.bench.batch with its defaults for the chosen text models."""
    from tools.bench import batch
    args = batch.arg_parser().parse_args([])
    args.models, args.skip_hf, args.device, args.json_out = models, skip_hf, device, json_out
    batch.run(args, command=shlex.join(["llama32", "bench", *_bench_args(sys.argv)]))


def _serve_bench(models: list[str], device: str, skip_hf: bool, json_out) -> None:
    """tools.bench.serve with its defaults for the chosen text models."""
    from tools.bench import serve
    args = serve.arg_parser().parse_args([])
    args.models, args.skip_hf, args.device, args.json_out = models, skip_hf, device, json_out
    serve.run(args, command=shlex.join(["llama32", "bench", *_bench_args(sys.argv)]))


@click.command()
@click.option("--models", default="1b,3b", show_default=True,
              help="Comma-separated: 1b, 3b, 11b-vision, 90b-vision (empty: none).")
@click.option("--skip-hf", is_flag=True, help="Skip HF transformers' eager generate.")
@click.option("--skip-attention", is_flag=True, help="Skip the attention micro-benchmarks.")
@click.option("--new-tokens", default=256, show_default=True, type=Count(1), help="Decode tokens timed.")
@click.option("--prefill-tokens", default=2048, show_default=True, type=Count(1))
@click.option("--device", default="cuda", show_default=True)
@click.option("--profile", is_flag=True, help="Also print per-kernel profiles of eager decode steps and a prefill.")
@click.option("--train", "train", is_flag=True, help="Only the LoRA training benchmark (ours vs HF + PEFT).")
@click.option("--quant", "quant", default=None,
              help="Comma-separated --quant formats (e.g. int8,int4): rows beside bf16, measured in the same run.")
@click.option("--batch", "batch", is_flag=True,
              help="Only the batched-decoding benchmark (tools/bench/batch.py): B = 1..256 at 512-token contexts and "
                   "a 1000-request workload, against the roofline and HF generate_batch.")
@click.option("--serve", "serve", is_flag=True,
              help="Only the serving benchmark (tools/bench/serve.py): `llama32 serve` against `transformers serve` "
                   "under Poisson arrivals (1b unless --models says otherwise).")
@click.option("--json-out", "json_out", default=None, type=UserPath(output=True),
              help="Also write the results as JSON here.")
@TP_OPTION
def bench(models, skip_hf, skip_attention, new_tokens, prefill_tokens, device, profile, json_out, train=False,
          quant=None, batch=False, serve=False, tp=1):
    """Benchmark the accel engine on a CUDA GPU (random weights at the real Llama 3.2 shapes). With --tp N: batch-1
    decode at TP=1 and TP=N in the same run (tools/bench/tp.py)."""
    common = _benchmarks()
    MODELS = common.MODELS
    chosen = [m.strip() for m in models.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in MODELS and m not in VISION_MODELS]
    if unknown:
        raise GenerationError(f"--models: unknown model {unknown[0]!r} (expected a list of "
                              f"{', '.join([*MODELS, *VISION_MODELS])})")
    import torch
    if not torch.cuda.is_available():
        raise GenerationError("llama32 bench needs a CUDA GPU (torch.cuda.is_available() is False here)")
    if tp > 1:
        vision = next((m for m in chosen if m in VISION_MODELS), None)
        _tp_bench(chosen, tp, new_tokens, json_out, **{f"--models {vision}": vision, "--batch": batch,
                                                       "--serve": serve, "--train": train, "--quant": quant,
                                                       "--profile": profile})
        return
    if batch:
        _batch_bench([m for m in chosen if m in MODELS], device, skip_hf, json_out)
        return
    if serve:
        given = click.get_current_context().get_parameter_source("models") != click.core.ParameterSource.DEFAULT
        _serve_bench([m for m in chosen if m in MODELS] if given else ["1b"], device, skip_hf, json_out)
        return
    from tools.bench import gpu as b
    with_hf = not skip_hf and importlib.util.find_spec("transformers") is not None
    result = common.record(device, command=shlex.join(["llama32", "bench", *_bench_args(sys.argv)]),
                           copy_tb_s=common.copy_bandwidth(device), gemm_tflop_s=common.gemm_tflops(device),
                           models=[])
    if train:
        from tools.bench.train import render as render_train, train_bench
        result["train"] = []
        for m in [m for m in chosen if m in MODELS]:
            click.echo(f"benchmarking LoRA training, {MODELS[m]} ...", err=True)
            result["train"].append(train_bench(MODELS[m], common.model_config(m), device, with_hf,
                                               seq=prefill_tokens))
        click.echo(render_train(result["train"]))
        common.write_record(json_out, result)
        return
    for m in [m for m in chosen if m in VISION_MODELS]:
        from tools.bench import vision
        if m == "11b-vision":
            click.echo(f"benchmarking {m} ...", err=True)
            result.setdefault("vision", []).append(vision.vision_bench(
                m, device, with_hf, copy_tb_s=result["copy_tb_s"], gemm_tflop_s=result["gemm_tflop_s"]))
        result.setdefault("vision_memory", []).append(vision.fits_report(m, device))
    for m in [m for m in chosen if m in MODELS]:
        if profile:
            click.echo(f"per-kernel device time of 10 eager decode steps, {MODELS[m]}:\n"
                       + b.profile_decode(common.model_config(m), device))
            click.echo(f"per-kernel device time of one {prefill_tokens}-token prefill, {MODELS[m]}:\n"
                       + b.profile_prefill(common.model_config(m), device, prefill_tokens))
        click.echo(f"benchmarking {MODELS[m]} ...", err=True)
        result["models"].append(b.model_bench(MODELS[m], common.model_config(m), device, with_hf, new_tokens,
                                              prefill_tokens=prefill_tokens, copy_tb_s=result["copy_tb_s"]))
    if quant:
        from tools.bench import quant_gpu
        from tools.engines import parse_quant
        specs = [str(parse_quant(q.strip())) for q in quant.split(",") if q.strip()]
        result["quant"], result["quant_gemv"] = [], {}
        for m in chosen:
            click.echo(f"benchmarking {MODELS[m]} quantized ({', '.join(specs)}) ...", err=True)
            result["quant"] += quant_gpu.quant_bench(MODELS[m], common.model_config(m), device, specs, new_tokens,
                                                     prefill_tokens, result["copy_tb_s"])
            one_format = [s for s in specs if ":mixed" not in s]  # a mixed spec's GEMVs are its formats' rows
            if one_format:
                result["quant_gemv"][MODELS[m]] = quant_gpu.gemv_bench(common.model_config(m), device, one_format)
    if not skip_attention:
        click.echo("benchmarking attention ...", err=True)
        result["attention"] = b.attention_bench(device)
        result["decode_attention"] = b.decode_attention_bench(device)
    click.echo(render(result))
    if quant:
        from tools.bench.quant_gpu import render as render_quant
        click.echo("\n" + render_quant(result))
    common.write_record(json_out, result)
