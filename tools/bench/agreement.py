"""Top-1 agreement of the accel engine (bf16 by default) with the fp32 refimpl on the same random weights.

The refimpl decodes greedily (fp32, NumPy) for N steps after a P-token prompt. The accel engine is then
teacher-forced along the refimpl's tokens: at every step it sees the same prefix, and we count how often its argmax
is the refimpl's token. Where they differ we report the refimpl's own top-1/top-2 logit gap: bf16 rounding can only
flip near-ties. Also reported: how many tokens accel's free-running greedy output shares with the refimpl's.

Weights are stored as bf16 values by default (`--weights bf16`), as the released Llama 3.2 checkpoints are: both
engines then read the same numbers and only the compute precision differs (the refimpl computes in fp32 NumPy).
`--weights fp32` keeps the random fp32 draws, so bf16 accel also rounds every weight.

Models:
    text    a Llama preset (default Llama-3.2-1B shapes): matrices N(0, 0.02) (HF's init scale); the tied embedding
            N(0, 0.066), so that logits have a standard deviation near 3 as in trained models (0.066·sqrt(2048) ≈ 3)
            instead of an almost flat distribution;
    vision  (--vision) a tiny random Llama 3.2 Vision config (`VISION_TINY`) whose every parameter matters
            (tools.vision_toy.random_vision_params: every tanh gate open, signs mixed), one image of 4 tiles
            before the prompt's text, so every cross layer and the whole encoder feed each step's logits.

    python -m tools.bench.agreement [--preset llama-3.2-1b | --vision] [--steps 256] [--weights bf16|fp32]
                                    [--json-out agreement.json]
"""
from __future__ import annotations

import time

import numpy as np

from refimpl.formats.params import Checkpoint, random_params
from refimpl.generate import RefEngine
from refimpl.generate_vision import VisionEngine
from refimpl.model.config import PRESETS
from refimpl.model.vision_config import MllamaConfig
from refimpl.quant.schemes import round_bf16
from refimpl.vision.inputs import ImageInputs
from refimpl.vision.prompt import cross_attention_mask
from tools.bench.common import parser, record, write_record
from tools.vision_toy import random_vision_params

VISION_TINY = {  # 6 text layers (2 cross), 4 tiles of 2×2 patches (5 tokens, padded to 8), 3 + 1 encoder layers
    "model_type": "mllama", "image_token_index": 512,
    "text_config": {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 6,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "cross_attention_layers": [1, 4],
                    "max_position_embeddings": 1024, "rope_theta": 500000.0},
    "vision_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_global_layers": 1,
                      "attention_heads": 4, "image_size": 28, "patch_size": 14, "max_num_tiles": 4,
                      "vision_output_dim": 64 * 3, "intermediate_layers_indices": [0, 2]},
}


def vision_inputs(cfg: MllamaConfig, prompt_tokens: int, seed: int = 1) -> tuple[list[int], ImageInputs]:
    """A prompt: <|image|> (all max_num_tiles tiles, a 2×2 grid) then prompt_tokens - 1 random text tokens."""
    rng = np.random.default_rng(seed)
    v = cfg.vision
    A = v.max_num_tiles
    ids = [cfg.image_token_index] + rng.integers(0, cfg.text.vocab_size, prompt_tokens - 1).tolist()
    pixels = rng.standard_normal((1, A, v.num_channels, v.image_size, v.image_size)).astype(np.float32)
    ratio = v.supported_aspect_ratios.index((2, 2)) + 1
    mask = cross_attention_mask(ids, cfg.image_token_index, [A], A)  # [T, 1, A]
    return ids, ImageInputs.from_arrays(v, pixels, [ratio], np.ones((1, A), np.int64), mask)


def refimpl_greedy(first_logits, step, steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens from the prompt's logits, step(token, i) -> the next logits; and each step's top-1/top-2 gap."""
    logits, tokens, gaps = first_logits, [], []
    for i in range(steps):
        top2 = np.sort(logits)[-2:]
        tokens.append(int(np.argmax(logits)))
        gaps.append(float(top2[1] - top2[0]))
        if i + 1 < steps:
            logits = step(tokens[-1], i)
    return tokens, gaps


def teacher_forced(first_logits, step, tokens: list[int]) -> list[bool]:
    """Whether the engine's argmax is tokens[i] at every step i, fed tokens[i] after it (step(token, i))."""
    logits, agree = first_logits, []
    for i, token in enumerate(tokens):
        agree.append(int(logits[0].float().argmax()) == token)
        if i + 1 < len(tokens):
            logits = step(token, i)
    return agree


def stored(params: dict[str, np.ndarray], weights: str) -> dict[str, np.ndarray]:
    """The checkpoint's values: each weight rounded to bf16 (kept as float32 arrays), or the fp32 draws as they are."""
    return {k: round_bf16(v) for k, v in params.items()} if weights == "bf16" else params


def run(model: str, ref, engine, prompt: list[int], steps: int, images: ImageInputs | None = None) -> dict:
    """The refimpl's greedy run, accel teacher-forced along it, and accel's free-running greedy -> the result."""
    import torch

    inputs = {} if images is None else {"images": images}
    P = len(prompt)
    cache = ref.new_cache(P + steps)
    t0 = time.perf_counter()
    tokens, gaps = refimpl_greedy(ref.logits(prompt, np.arange(P), cache, **inputs),
                                  lambda token, i: ref.logits([token], [P + i], cache), steps)
    ref_s = time.perf_counter() - t0
    print(f"refimpl: {steps} greedy steps in {ref_s:.0f} s", flush=True)

    device = engine.device
    sess = engine.session(P + steps, engine.image_tokens(images)) if images is not None else engine.session(P + steps)
    agree = teacher_forced(engine.prefill(prompt, sess, **inputs),
                           lambda token, i: sess.decoder.step(torch.tensor([token], device=device), P + i), tokens)
    free = engine.decode_greedy(sess, engine.prefill(prompt, sess, **inputs), P, steps).tolist()
    shared = next((i for i, (a, b) in enumerate(zip(free, tokens)) if a != b), steps)
    flips = [gaps[i] for i, ok in enumerate(agree) if not ok]
    return {
        "model": model, "accel_dtype": engine.dtype_name, "steps": steps, "prompt_tokens": P,
        "top1_agreement": sum(agree) / len(agree), "disagreements": len(flips),
        "refimpl_gap_at_disagreements": flips, "refimpl_median_gap": float(np.median(gaps)),
        "free_running_shared_prefix": shared, "refimpl_seconds": ref_s,
    }


def print_table(r: dict) -> None:
    print(f"{'model':<14}{'dtype':>6}{'steps':>7}{'top-1 agree':>13}{'median gap':>12}{'max gap at flip':>17}"
          f"{'free-run shared':>17}")
    print(f"{r['model']:<14}{r['accel_dtype']:>6}{r['steps']:>7}{r['top1_agreement']:>13.4f}"
          f"{r['refimpl_median_gap']:>12.3f}{max(r['refimpl_gap_at_disagreements'], default=0.0):>17.4f}"
          f"{r['free_running_shared_prefix']:>17}")
    print(f"weights stored as {r['weights']}; device {r['device']}, {r['date']}")


def text_agreement(preset: str, steps: int, prompt_tokens: int, dtype: str, device, weights: str = "bf16") -> dict:
    from accel.engine import DTYPES, AccelEngine
    from accel.weights import load_weights

    cfg = PRESETS[preset]
    t0 = time.perf_counter()
    params = random_params(cfg, seed=0, std=0.02)
    params["model.embed_tokens.weight"] *= np.float32(0.066 / 0.02)
    params = stored(params, weights)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, prompt_tokens).tolist()
    print(f"weights built in {time.perf_counter() - t0:.0f} s", flush=True)
    ref = RefEngine(Checkpoint(None, cfg, params))
    engine = AccelEngine(cfg, load_weights(params, cfg, device, DTYPES[dtype]), device, dtype)
    return {**run(preset, ref, engine, prompt, steps), "weights": weights}


def vision_agreement(steps: int, prompt_tokens: int, dtype: str, device: str, use_triton: bool | None = None,
                     weights: str = "bf16") -> dict:
    from accel.vision.engine import VisionAccelEngine

    cfg = MllamaConfig.from_hf(VISION_TINY, source="VISION_TINY")
    ckpt = Checkpoint(None, cfg, stored(random_vision_params(cfg), weights))
    prompt, images = vision_inputs(cfg, prompt_tokens)
    engine = VisionAccelEngine.from_checkpoint(ckpt, device=device, dtype=dtype, use_triton=use_triton)
    return {**run("vision-tiny", VisionEngine(ckpt), engine, prompt, steps, images), "weights": weights}


def main(argv=None):
    ap = parser("tools.bench.agreement", __doc__)
    ap.add_argument("--preset", default="llama-3.2-1b", choices=sorted(PRESETS))
    ap.add_argument("--vision", action="store_true", help="the tiny random Llama 3.2 Vision model, with an image")
    ap.add_argument("--steps", type=int, default=None, help="default 256 (text), 128 (vision)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp32"],
                    help="the checkpoint's stored precision (default bf16, as released checkpoints)")
    args = ap.parse_args(argv)

    import torch

    if args.vision:
        result = vision_agreement(args.steps or 128, args.prompt_tokens, args.dtype, args.device,
                                  weights=args.weights)
    else:
        result = text_agreement(args.preset, args.steps or 256, args.prompt_tokens, args.dtype,
                                torch.device(args.device), args.weights)
    result = record(args.device, **result)
    print_table(result)
    write_record(args.json_out, result)
    return result


if __name__ == "__main__":
    main()
