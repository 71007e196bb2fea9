"""Quality of weight-only quantization: KL divergence and top-1 agreement against the unquantized model.

Teacher-forced over a fixed English passage (256 tokens): at every position the quantized model's next-token
distribution Q is compared with the unquantized one's P; reported per format and method are mean KL(P || Q) in nats
over the positions and the fraction where argmax Q == argmax P. Formats: int8, int4 with G = 32/64/128, each with
the lm_head quantized and kept unquantized (":bf16-head"). A benchmark, not a test: it asserts nothing.

    python -m tools.bench.quant_quality                       # SmolLM2-135M-Instruct on the CPU (the refimpl)
    python -m tools.bench.quant_quality --methods rtn,search,gptq --specs int8,int4:64   # offline quantizers
    python -m tools.bench.quant_quality --methods gptq --specs int8 --rotate 0   # the rotated model, seed 0
    python -m tools.bench.quant_quality --random-1b --device cuda   # random Llama-3.2-1B-shaped weights (accel bf16)

SmolLM2: the default model's Q4_1 GGUF dequantized to fp32 is the "unquantized" model; the quantized models
requantize those fp32 weights. Its linear layers already sit on Q4_1's grid (blocks of 32 columns, a scale and a
minimum each; the embedding is Q8_0), so int4:32, whose groups are those blocks, nearly reproduces them, while
int4:64 pays for moving them onto another 4-bit grid: compare the int4:32 and int4:64 rows before blaming a method.
The refimpl runs them dequantized once (refimpl.quant.apply.dequantize_params): the same arithmetic as the refimpl's
--quant forward, without redoing it per call.
Methods (refimpl.quant.calibrate, as `llama32 quantize --method`): rtn (round to nearest, min/max: what --quant
does at load), search (error-minimizing ranges weighted by the calibration inputs), gptq, awq, awq-gptq (activation-
aware input scales, then search / gptq). Each row also gives the MB of matrices a decode step reads (the mixed
specs' price). All but rtn are
calibrated on `llama32 quantize`'s default text (tools/data/calibration-en.txt), which shares nothing with the
evaluation passage. --rotate SEED quantizes the model after refimpl.quant.rotate (norms folded, residual stream
and values rotated; `llama32 quantize --rotate` uses seed 0), against the same unrotated reference; its first row
("none", "rotated") is the rotated model unquantized, which must match the reference to fp32 rounding.
A spec with and without ":bf16-head" shares one quantized body (the body's calibration does
not depend on the head), so it is quantized once.
Random 1B: accel's bf16 engine in trace mode (all 256 positions' logits), the quantized engines quantizing the
same bf16 weights on the device; the tied embedding is scaled to std 0.066 so logits have a standard deviation
near 3, as in trained models (tools/bench/agreement.py does the same).
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as the CLI: one OpenBLAS thread on a shared machine

import platform  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from tools.bench.common import parser, record, write_record  # noqa: E402

SPECS = ["int8", "int8:bf16-head", "int4:32", "int4:32:bf16-head", "int4:64", "int4:64:bf16-head", "int4:128",
         "int4:128:bf16-head", "int4:64:mixed", "int4:64:mixed:bf16-head"]
TOKENS = 256

# Public domain (Dickens, A Tale of Two Cities, 1859): ordinary English the model has seen the like of.
PASSAGE = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, "
    "it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was the season of "
    "Darkness, it was the spring of hope, it was the winter of despair, we had everything before us, we had nothing "
    "before us, we were all going direct to Heaven, we were all going direct the other way - in short, the period "
    "was so far like the present period, that some of its noisiest authorities insisted on its being received, for "
    "good or for evil, in the superlative degree of comparison only. There were a king with a large jaw and a queen "
    "with a plain face, on the throne of England; there were a king with a large jaw and a queen with a fair face, "
    "on the throne of France. In both countries it was clearer than crystal to the lords of the State preserves of "
    "loaves and fishes, that things in general were settled for ever. It was the year of Our Lord one thousand "
    "seven hundred and seventy-five. Spiritual revelations were conceded to England at that favoured period, as at "
    "this. Mrs. Southcott had recently attained her five-and-twentieth blessed birthday, of whom a prophetic private "
    "in the Life Guards had heralded the sublime appearance by announcing that arrangements were made for the "
    "swallowing up of London and Westminster. Even the Cock-lane ghost had been laid only a round dozen of years, "
    "after rapping out its messages, as the spirits of this very year last past (supernaturally deficient in "
    "originality) rapped out theirs. Mere messages in the earthly order of events had lately come to the English "
    "Crown and People, from a congress of British subjects in America.")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kl_and_top1(ref_logits: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    """[T, V] each -> (mean over T of KL(P_ref || P), fraction of T with the same argmax)."""
    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)  # [T]
    return float(kl.mean()), float((ref_logits.argmax(-1) == logits.argmax(-1)).mean())


def matrix_bytes(params: dict, cfg) -> dict:
    """{name: bytes a decode step reads} of every linear layer and the lm_head: a QuantizedLinear's codes, scales
    and minima, or 2 bytes a value for an unquantized (bf16) matrix. Norms and one embedding row are left out
    (under 0.1 MB for SmolLM2)."""
    from refimpl.quant.apply import quantized_names, source_weight
    return {n: (w.nbytes if hasattr(w, "dequantize") else 2 * w.size)
            for n in quantized_names(cfg, True) for w in [params[n] if n in params else source_weight(params, n)]}


def smollm2_rows(specs: list[str], methods: list[str], rotate: int | None = None) -> tuple[dict, list[dict]]:
    from refimpl.formats.checkpoint import load_checkpoint
    from refimpl.model import ops
    from refimpl.model.llama import KVCache, forward
    from refimpl.quant.apply import LM_HEAD, dequantize_params
    from refimpl.quant.calibrate import calibration_sequences, quantize_model
    from refimpl.quant.schemes import QuantSpec
    from refimpl.quant.rotate import rotate_model
    from tools.cli.quantize import CALIBRATION
    from tools.default_model import default_model_path

    path = default_model_path(fetch_if_missing=True)
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    ids = np.asarray(ckpt.tokenizer.encode(PASSAGE)[:TOKENS], np.int64)
    assert len(ids) == TOKENS, f"the passage gives only {len(ids)} tokens"
    calib = calibration_sequences(ckpt.tokenizer, CALIBRATION.read_text())

    def logits_of(params, cfg=cfg):
        cache = KVCache.allocate(cfg, TOKENS, lambda s: np.zeros(s, np.float32))
        return forward(ops, params, cfg, ids, np.arange(TOKENS), cache)  # [T, V]

    t0 = time.perf_counter()
    ref = logits_of(ckpt.params)
    print(f"unquantized forward of {TOKENS} tokens: {time.perf_counter() - t0:.1f} s", flush=True)
    source, qcfg, rows = ckpt.params, cfg, []
    if rotate is not None:  # quantize the rotated model; the reference stays the original
        source, qcfg = rotate_model(ckpt.params, cfg, seed=rotate)
        rotated = logits_of(source, qcfg)
        kl, top1 = kl_and_top1(ref, rotated)
        rows.append({"quant": "none", "method": "rotated", "kl_mean": kl, "top1_agreement": top1,
                     "max_abs_logit_diff": float(np.abs(ref - rotated).max())})
        print(f"rotated, unquantized: KL {kl:.3e}  top-1 {top1:.4f}  max |Δlogit| "
              f"{rows[-1]['max_abs_logit_diff']:.2e}", flush=True)
    bodies = {}  # (spec without the head suffix, method) -> params with the head quantized too
    for method in methods:
        for text in specs:
            spec = QuantSpec.parse(text)
            full = QuantSpec(spec.format, spec.group, True, spec.int8_keys)
            t0 = time.perf_counter()
            if (str(full), method) not in bodies:
                quantized = quantize_model(source, qcfg, full, method, None if method == "rtn" else calib)
                bodies[str(full), method] = dequantize_params(quantized), matrix_bytes(quantized, qcfg)
            deq, sizes = bodies[str(full), method]
            params = dict(deq)
            read = sum(sizes.values()) - (0 if spec.lm_head else sizes[LM_HEAD] - 2 * ckpt.params[
                "model.embed_tokens.weight"].size)  # a bf16 head reads V·D bf16 values
            if not spec.lm_head:  # the unquantized head again, after its own final norm (AWQ folds the
                params.pop(LM_HEAD)  # quantized head's scales into the norm); a tied one is the embedding
                params |= {k: source[k] for k in (LM_HEAD, "model.norm.weight") if k in source}
            kl, top1 = kl_and_top1(ref, logits_of(params, qcfg))
            rows.append({"quant": text, "method": method, "rotation_seed": rotate, "kl_mean": kl,
                         "top1_agreement": top1,
                         "matrix_mb_per_token": read / 1e6, "seconds": time.perf_counter() - t0})
            print(f"{text:<26}{method:<9} KL {kl:.3e}  top-1 {top1:.4f}  {read / 1e6:.1f} MB  "
                  f"({rows[-1]['seconds']:.0f} s)", flush=True)
    return {"model": f"SmolLM2-135M-Instruct ({path.name}, dequantized to fp32)", "engine": "refimpl fp32 (CPU)",
            "calibration": f"{CALIBRATION.name}, {sum(len(s) for s in calib)} tokens in {len(calib)} sequences "
                           f"(every method but rtn)",
            "rotation": None if rotate is None else f"residual stream and values, refimpl.quant.rotate seed {rotate}",
            "machine": platform.processor() or platform.machine()}, rows


def random_1b_rows(specs: list[str], device: str) -> tuple[dict, list[dict]]:
    import torch

    from accel.engine import AccelEngine
    from accel.quant_layers import quantize_weights
    from accel.weights import random_weights
    from refimpl.model.config import PRESETS
    from refimpl.model.llama import run_steps
    from refimpl.quant.schemes import QuantSpec

    cfg = PRESETS["llama-3.2-1b"]
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, TOKENS)

    def logits_of(spec):
        w = random_weights(cfg, device, torch.bfloat16, seed=0)
        w.embed.mul_(0.066 / 0.02)  # tied: the lm_head too
        if spec is not None:
            w = quantize_weights(w, spec)
        engine = AccelEngine(cfg, w, torch.device(device), "bf16", use_graph=False)
        cache = engine.new_cache(TOKENS)
        with torch.no_grad():
            out = run_steps(engine.steps(ids, np.arange(TOKENS), cache))  # [T, V]
        return out.float().cpu().numpy()

    ref = logits_of(None)
    rows = []
    for text in specs:
        t0 = time.perf_counter()
        kl, top1 = kl_and_top1(ref, logits_of(QuantSpec.parse(text)))
        rows.append({"quant": text, "method": "rtn", "kl_mean": kl, "top1_agreement": top1,
                     "seconds": time.perf_counter() - t0})
        print(f"{text:<22} KL {kl:.3e}  top-1 {top1:.4f}", flush=True)
    return {"model": "random Llama-3.2-1B-shaped weights (seed 0, embedding std 0.066), random token ids",
            "engine": "accel bf16 trace mode", "machine": torch.cuda.get_device_name(device)}, rows


def main(argv=None):
    ap = parser("tools.bench.quant_quality", __doc__)
    ap.add_argument("--random-1b", action="store_true", help="random Llama-3.2-1B weights on --device (accel)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--specs", default=",".join(SPECS), help="comma-separated --quant formats")
    ap.add_argument("--methods", default="rtn", help="comma-separated: rtn, search, gptq, awq, awq-gptq (SmolLM2 "
                                                     "only)")
    ap.add_argument("--rotate", type=int, default=None, metavar="SEED", help="quantize the model rotated with "
                    "this seed (SmolLM2; refimpl.quant.rotate); the reference stays the original")
    args = ap.parse_args(argv)
    specs = [s for s in args.specs.split(",") if s]
    methods = [m for m in args.methods.split(",") if m]
    if args.random_1b and methods != ["rtn"]:
        ap.error("--random-1b quantizes on the device: --methods rtn only")
    if args.random_1b and args.rotate is not None:
        ap.error("--rotate is for SmolLM2 (the refimpl quantizers)")
    head, rows = random_1b_rows(specs, args.device) if args.random_1b else smollm2_rows(specs, methods, args.rotate)
    result = record(args.device if args.random_1b else "cpu", **head, tokens=TOKENS, rows=rows)
    print(f"\n{result['model']} — {result['engine']} — {result['date']}")
    print(f"{'quant':<26}{'method':<9}{'mean KL (nats)':>16}{'top-1 agree':>13}{'MB/token':>10}")
    for r in rows:
        mb = f"{r['matrix_mb_per_token']:>10.1f}" if "matrix_mb_per_token" in r else ""
        print(f"{r['quant']:<26}{r['method']:<9}{r['kl_mean']:>16.3e}{r['top1_agreement']:>13.4f}{mb}")
    write_record(args.json_out, result)


if __name__ == "__main__":
    main()
