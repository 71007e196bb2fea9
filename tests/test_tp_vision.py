"""Tensor parallelism (accel.tp) for Llama 3.2 Vision and for int8 weights, on the CPU over gloo, 2 ranks.

Oracles: HF transformers' MllamaForConditionalGeneration (greedy ids of `generate --image --tp 2`, the logits of
prompts with two images, text before the first, one KV head replicated on both ranks), and for `--quant int8`
HF's model holding the weights refimpl.quant.schemes quantizes (NumPy) as the ranks keep them: whole rows for the
column-parallel matrices and the lm_head (the unsharded int8 scales), each rank's column half for the
row-parallel o_proj / down_proj (that half's own scale). Each rank quantizes with accel.quant_ops on torch; HF
runs the dequantized values in fp32; so equal greedy ids test the slicing, the per-shard quantization and the
forward at once, and the one-process int8 engine (whole-row scales everywhere) is held to a logit NMSE bound."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoProcessor, LlamaForCausalLM, MllamaForConditionalGeneration

from accel.engine import AccelEngine
from accel.tp.group import free_port
from accel.tp.vision_load import VisionShardPlan, vision_shard_elements
from refimpl.compare import TOLERANCES, compare
from refimpl.formats.checkpoint import load_checkpoint
from refimpl.formats.vision_checkpoint import expected_vision_shapes
from refimpl.model.vision_config import MllamaConfig
from refimpl.quant.schemes import QuantSpec
from tests._mllama_hf import IMAGE, cross_mask, hf_logits, hf_model, image_arrays
from tests._tp_harness import run_job
from tests.test_tp import PROMPT, hf_model as hf_text_model

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "golden" / "toy-vision"
PICTURE = TOY / "image.png"
ASK = "Look at this picture: <|image|> and tell me about the sea in it."
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


def cli(*args, launcher=(sys.executable, "-m")) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([*launcher, "tools.cli", *args, "--json"], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def shard_quantized(name: str, w: torch.Tensor, spec: QuantSpec, world: int = 2) -> torch.Tensor:
    """w as a rank set keeps it under --quant spec, dequantized by the NumPy oracle: row-parallel matrices
    quantized per column slice, the others per whole row."""
    a = w.detach().float().numpy()
    parts = np.split(a, world, axis=1) if name.endswith(ROW_PARALLEL) else [a]
    return torch.from_numpy(np.concatenate([spec.quantize(p).dequantize() for p in parts], axis=1))


def quantize_decoder(model, decoder_prefix: str, spec: QuantSpec = QuantSpec("int8")) -> None:
    """The decoder's matrices (and the lm_head) of an HF model replaced by shard_quantized's values, in place."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and (name.startswith(decoder_prefix) and "proj" in name or "lm_head" in name):
                p.copy_(shard_quantized(name, p, spec))


def hf_greedy(model, n: int, **inputs) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


# ---- generate --image --tp 2 ----

@pytest.fixture(scope="module")
def toy_hf():
    processor = AutoProcessor.from_pretrained(TOY, use_fast=False)
    inputs = processor(text=ASK, images=[[str(PICTURE)]], return_tensors="pt")
    return processor, inputs


@pytest.mark.parametrize("torchrun", [False, True])
def test_generate_image_tp2_equals_hf(toy_hf, torchrun):
    """Started by llama32 itself, and under torchrun (every rank runs the command; rank 0 answers)."""
    launcher = (sys.executable, "-m")
    if torchrun:
        launcher = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                    "127.0.0.1", "--master-port", str(free_port()), "-m")
    record = cli("generate", ASK, "--model", str(TOY), "--image", str(PICTURE), "--tp", "2", "--device", "cpu",
                 "--max-new-tokens", "12", launcher=launcher)
    model = MllamaForConditionalGeneration.from_pretrained(TOY, dtype=torch.float32).eval()
    assert record["prompt_ids"] == toy_hf[1]["input_ids"][0].tolist()
    assert record["generated_ids"] == hf_greedy(model, 12, **toy_hf[1])


@pytest.mark.parametrize("quant", ["int8", "int4:32"])
def test_generate_image_tp2_quantized_equals_hf_on_the_ranks_quantized_weights(toy_hf, quant):
    """int4:32: rank slices of down_proj (48 columns) end in a 16-column group, as the oracle's halves do."""
    record = cli("generate", ASK, "--model", str(TOY), "--image", str(PICTURE), "--tp", "2", "--device", "cpu",
                 "--max-new-tokens", "10", "--quant", quant)
    model = MllamaForConditionalGeneration.from_pretrained(TOY, dtype=torch.float32).eval()
    plain = hf_greedy(model, 10, **toy_hf[1])
    quantize_decoder(model, "model.language_model.", QuantSpec.parse(quant))
    want = hf_greedy(model, 10, **toy_hf[1])
    assert record["generated_ids"] == want
    assert record["quant"] == quant and want != plain  # the quantization shows in the toy's answer


def test_chat_tp2_text_turns_equal_the_refimpl():
    """A Vision model's chat (text turns, each continuing in the ranks' kept caches) as the refimpl's."""
    def chat(*extra):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-m", "tools.cli", "chat", "--model", str(TOY), "--max-new-tokens",
                               "6", *extra], input="the sea\nand the moon?\n", capture_output=True, text=True,
                              env=env, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        return done.stdout
    tp2 = chat("--tp", "2", "--device", "cpu")
    assert tp2 == chat("--backend", "refimpl") and tp2.count("> ") == 2


# ---- logits against HF: two images, text before the first, MQA and GQA ----

def two_image_prompt():
    ids = [5, 17, 9, IMAGE, 40, 41, 42, IMAGE, 50, 60, 70, 80]
    tiles = [(1, 2), (2, 2)]
    pixels, ar_ids, ar_mask = image_arrays(tiles, seed=3)
    return ids, pixels, ar_ids, ar_mask, cross_mask(ids, [2, 4])


TEXT_ONLY = [5, 17, 9, 40, 41, 42]  # no image token: the cross layers skipped
MORE = [33, 7, 90, 4, 61]  # decoded tokens: each one fused decode step on the ranks


@pytest.fixture(scope="module")
def vision_ranks(tmp_path_factory):
    """name -> (HF's logits at the prompt's last token and two decode steps, both ranks' results); also, for the
    GQA model, the cases "gqa-image" (its images, five decoded tokens) and "gqa-text" (no image, five)."""
    ids, pixels, ar_ids, ar_mask, xmask = two_image_prompt()
    decoded = [33, 7]
    full = ids + decoded
    full_mask = np.concatenate([xmask, np.repeat(xmask[-1:], len(decoded), axis=0)])  # as HF's generate extends it
    out, cases = {}, {}
    for name, kv in (("mqa", 1), ("gqa", 2)):
        model = hf_model(seed=kv, kv_heads=kv)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        ref = hf_logits(model, full, pixels, ar_ids, ar_mask, full_mask)[len(ids) - 1:]  # [3, V]
        np.savez(path / "images.npz", pixel_values=pixels, aspect_ratio_ids=ar_ids, aspect_ratio_mask=ar_mask,
                 cross_attention_mask=xmask)
        cases[name] = {"dir": str(path), "images": str(path / "images.npz"), "steps": [ids, *[[t] for t in decoded]],
                       "capacity": len(full)}
        out[name] = ref
    gqa = cases["gqa"]
    cases["gqa-image"] = {**gqa, "steps": [ids, *[[t] for t in MORE]], "capacity": len(ids) + len(MORE)}
    cases["gqa-text"] = {"dir": gqa["dir"], "steps": [TEXT_ONLY, *[[t] for t in MORE]],
                         "capacity": len(TEXT_ONLY) + len(MORE)}
    ranks = run_job({"kind": "vision", "cases": cases}, tmp_path_factory.mktemp("tpv"))
    return {name: (out.get(name), [r[name] for r in ranks], cases[name]) for name in cases}


@pytest.mark.parametrize("name", ["mqa", "gqa"])
def test_tp2_logits_with_two_images_equal_hf(vision_ranks, name):
    ref, ranks, _ = vision_ranks[name]
    for step, (want, got) in enumerate(zip(ref, ranks[0]["logits"])):
        c = compare(f"{name} step {step}", np.array(got), want, TOLERANCES["fp32"])
        assert c.ok, f"{name} step {step}: max_abs {c.max_abs:.3g} nmse {c.nmse:.3g} at {c.worst} {c.problem}"
    assert ranks[0]["logits"] == ranks[1]["logits"]


@pytest.mark.parametrize("name", ["gqa-image", "gqa-text"])
def test_tp2_decode_step_equals_the_one_device_engine(vision_ranks, name):
    """Each decoded token runs accel.vision.model.decode_step over the split (RankSplit: the cross layers' gated
    o/down partial sums reduced across the ranks): its logits, five tokens on, as the one-device engine's decode
    step (accel.vision.engine, no split) and as the ranks' own eager forward of the same token, with the
    image and without (the cross layers skipped)."""
    from accel.vision.engine import VisionAccelEngine
    from refimpl.vision.inputs import ImageInputs
    _, ranks, case = vision_ranks[name]
    engine = VisionAccelEngine.from_checkpoint(load_checkpoint(Path(case["dir"]), with_tokenizer=False),
                                               device="cpu", dtype="fp32", use_triton=False)
    images = None
    if "images" in case:
        with np.load(case["images"], allow_pickle=False) as f:
            images = ImageInputs(*(f[k] for k in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask",
                                                  "cross_attention_mask")))
    prompt, *decoded = case["steps"]
    sess = engine.session(case["capacity"], engine.image_tokens(images))
    ref = [engine.prefill(prompt, sess, images)[0].numpy().copy()]
    for n, token in enumerate(decoded):
        ref.append(sess.decoder.step(torch.tensor(token), len(prompt) + n)[0].numpy().copy())
    got = ranks[0]["logits"]
    assert len(got) == len(ref) == 1 + len(MORE) and len(ranks[0]["eager"]) == len(MORE)
    for step, want in enumerate(ref):
        c = compare(f"{name} step {step}", np.array(got[step]), want, TOLERANCES["fp32"])
        assert c.ok, f"{name} step {step}: max_abs {c.max_abs:.3g} nmse {c.nmse:.3g} at {c.worst} {c.problem}"
    for step, eager in enumerate(ranks[0]["eager"], start=1):
        c = compare(f"{name} eager {step}", np.array(got[step]), np.array(eager), TOLERANCES["fp32"])
        assert c.ok, f"{name} eager {step}: max_abs {c.max_abs:.3g} nmse {c.nmse:.3g} at {c.worst} {c.problem}"
    assert ranks[0]["logits"] == ranks[1]["logits"]
    assert not np.allclose(got[1], got[2])  # each step's own logits, not the graph's buffer read twice


def test_vision_shard_plan_splits_the_decoder_and_replicates_the_encoder():
    cfg = MllamaConfig.from_file(TOY / "config.json")
    shapes = expected_vision_shapes(cfg)
    plans = [VisionShardPlan(cfg, r, 2) for r in range(2)]
    t = cfg.text
    p = "language_model.model.layers.1."  # a cross layer
    assert [pl.slice_of(p + "cross_attn.q_proj.weight") for pl in plans] == [
        plans[0].text.slice_of("model.layers.0.self_attn.q_proj.weight"),
        plans[1].text.slice_of("model.layers.0.self_attn.q_proj.weight")]
    assert plans[1].slice_of(p + "cross_attn.k_proj.weight").start == t.head_dim  # rank 1's KV head
    assert plans[0].slice_of(p + "cross_attn.o_proj.weight").dim == 1
    assert plans[0].slice_of(p + "cross_attn.q_norm.weight") is None
    assert plans[0].embed_range() == (0, 148) and plans[1].embed_range() == (148, 296)  # V + 8 = 296 rows
    replicated = sum(np.prod(s) for n, s in shapes.items() if plans[0].slice_of(n) is None)
    total = sum(np.prod(s) for s in shapes.values())
    assert sum(vision_shard_elements(pl) for pl in plans) == total + replicated  # every split tensor cut in 2


# ---- int8 on a text model: HF on the ranks' quantized weights, and the one-process int8 engine ----

@pytest.fixture(scope="module")
def text_int8(tmp_path_factory):
    model = hf_text_model(4, 2, 64, False)
    path = tmp_path_factory.mktemp("text8")
    model.save_pretrained(path)
    steps = [{"ids": PROMPT, "start": 0}, {"ids": [9], "start": len(PROMPT)}]
    ranks = run_job({"kind": "cases", "cases": {"m": {
        "dir": str(path), "quant": "int8", "steps": steps, "capacity": len(PROMPT) + 8,
        "requests": [{"prompt": PROMPT, "max_new": 8}]}}}, tmp_path_factory.mktemp("tp8"))
    return model, path, steps, ranks


def test_tp2_int8_greedy_equals_hf_on_the_ranks_quantized_weights(text_int8):
    model, _, _, ranks = text_int8
    quantize_decoder(model, "model.layers.")
    assert ranks[0]["m"]["tokens"][0] == hf_greedy(model, 8, input_ids=torch.tensor([PROMPT]))
    assert ranks[0]["m"]["shapes"]["o"] == [48, 24]  # [D, H/N·E]: the row-parallel slice, quantized whole


def test_tp2_int8_logits_near_one_process_int8(text_int8):
    """The one-process engine quantizes o/down per whole row, the ranks per column half: close, not equal."""
    _, path, steps, ranks = text_int8
    one = AccelEngine.from_checkpoint(load_checkpoint(path, with_tokenizer=False), device="cpu", dtype="fp32",
                                      use_triton=False, quant=QuantSpec.parse("int8"))
    sess = one.session(len(PROMPT) + 8)
    for i, step in enumerate(steps):
        ref = one.prefill(step["ids"], sess, step["start"])[0].float().numpy()
        got = np.array(ranks[0]["m"]["logits"][i])
        nmse = float(((got - ref) ** 2).mean() / (ref ** 2).mean())
        assert 0 < nmse < 1e-4, nmse  # differs (other o/down scales), within llama.cpp's "excellent"



@pytest.mark.parametrize("quant", [None, "int8", "int4:32"])
def test_random_shard_has_the_loaded_shards_shapes_and_types(quant):
    """The benchmark's random weights (accel.tp.random_shard) are a rank's shard as the loader builds it."""
    from accel.quant_ops import QuantTensor
    from accel.tp.vision_load import load_vision_shard, random_vision_shard
    plan = VisionShardPlan(MllamaConfig.from_file(TOY / "config.json"), 1, 2)
    spec = QuantSpec.parse(quant) if quant else None
    loaded = load_vision_shard(TOY, plan, "cpu", torch.float32, spec)
    drawn = random_vision_shard(plan, "cpu", torch.float32, spec)

    def leaves(w):
        yield from (w.text.embed, w.text.norm, w.text.lm_head, *w.vision.values(), *w.vision_qkv.values())
        for lw in w.text.layers:
            yield from (lw.attn_norm, lw.qkv, lw.o, lw.mlp_norm, lw.gate_up, lw.down)
        for cl, kv in zip(w.cross, w.image_kv):
            yield from (*vars(cl).values(), *kv)

    def kind(t):
        return (type(t).__name__, t.fmt, t.group, tuple(t.shape), tuple(t.scale.shape)) \
            if isinstance(t, QuantTensor) else (type(t).__name__, tuple(t.shape), t.dtype)
    assert [kind(t) for t in leaves(drawn)] == [kind(t) for t in leaves(loaded)]
    assert drawn.self_layers == loaded.self_layers and len(drawn.vision_gates) == len(loaded.vision_gates)


def test_a_rank_loads_its_vision_shard_without_the_whole_model(tmp_path):
    """Host memory, as tests/test_tp.py's text case: each rank's high-water mark rises by its shard (half the
    decoder, the whole small encoder) and one slice, well under the whole model."""
    from refimpl.formats.checkpoint import save_checkpoint
    cfg = MllamaConfig.from_hf({"model_type": "mllama", "image_token_index": 8192, "vision_config": {
        "image_size": 28, "hidden_size": 64, "intermediate_size": 128, "attention_heads": 4, "num_hidden_layers": 2,
        "num_global_layers": 1, "intermediate_layers_indices": [0, 1], "vision_output_dim": 64 * 3},
        "text_config": {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 8,
                        "num_attention_heads": 8, "num_key_value_heads": 2, "cross_attention_layers": [3, 7]}})
    params = {name: np.full(shape, 0.01, np.float32) for name, shape in expected_vision_shapes(cfg).items()}
    model_bytes = sum(a.nbytes for a in params.values())
    save_checkpoint(tmp_path / "model", cfg, params)
    del params
    for r, rank in enumerate(run_job({"kind": "peak", "case": {"dir": str(tmp_path / "model")}}, tmp_path)):
        rise = (rank["peak_kib"] - rank["before_kib"]) * 1024
        assert rank["shard_bytes"] == 4 * vision_shard_elements(VisionShardPlan(cfg, r, 2))
        assert rank["shard_bytes"] < 0.52 * model_bytes
        assert rank["shard_bytes"] <= rise < 0.75 * model_bytes, (rise / 2**20, model_bytes / 2**20)
