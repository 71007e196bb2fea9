"""`llama32 finetune` on a Llama 3.2 Vision checkpoint against HF transformers + PEFT (the oracle), fp32 on the CPU.

The base is a tiny random MllamaForConditionalGeneration written in the test (every tanh gate nonzero, norms off 1)
with the toy tokenizer, the Llama 3.2 Vision chat template shape and a real preprocessor_config.json; HF's own
MllamaProcessor renders, tokenizes and tiles every oracle sample. One `--optimizer sgd` step from a PEFT adapter with
nonzero A and B must land every LoRA matrix (self- and cross-attention layers, MLPs) where PEFT lands it, measured
against the size of the step itself.
"""
import json
import os

import numpy as np
import pytest

from _badinput import assert_clean_error, run_cli
from test_finetune import lora_tensors, peft_sgd_step, write_jsonl

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.numpy import load_file  # noqa: E402

# the text decoder's linears only: PEFT's list form would also adapt the vision tower's q/k/v/o_proj
TEXT_REGEX = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
RECORDS = [
    {"messages": [{"role": "user", "content": "what is it"}, {"role": "assistant", "content": "the sea"}],
     "images": ["wide.png"]},
    # text before the image sees no image: its cross-attention rows are masked out
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"},
                                               {"type": "text", "text": "now"}]},
                  {"role": "assistant", "content": "a tall one"}], "images": ["tall.png"]},
    {"messages": [{"role": "system", "content": "Be short."},
                  {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and?"}]},
                  {"role": "assistant", "content": "red"},
                  {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "this?"}]},
                  {"role": "assistant", "content": "blue, it is"}], "images": ["tall.png", "wide.png"]},
    {"query": "no picture", "response": "then text"},  # a text sample: HF skips the cross layers for it
]
# image parts naming their own files (relative to the data file)
PATH_PARTS = {"messages": [{"role": "user", "content": [{"type": "image", "path": "img/tall.png"},
                                                        {"type": "text", "text": "and"},
                                                        {"type": "image", "path": "img/wide.png"}]},
                           {"role": "assistant", "content": "two"}]}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI machine's cores are shared
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(model dir, data dir with wide.png / tall.png): a 4-layer text decoder with cross-attention at 1 and 3."""
    from PIL import Image

    from tools.vision_toy import toy_image, write_vision_toy
    root = tmp_path_factory.mktemp("vision")
    model_dir = write_vision_toy(root, seed=11)
    data = root / "data"
    (data / "img").mkdir(parents=True)
    toy_image().save(data / "img" / "wide.png")  # 30×80: 1×3 tiles
    toy_image().transpose(Image.Transpose.ROTATE_90).resize((20, 50)).save(data / "img" / "tall.png")  # 2×1 tiles
    return model_dir, data


def hf_model(model_dir):
    return transformers.MllamaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_processor(model_dir):
    """HF's MllamaProcessor with the PIL image backend, the one refimpl's processor reproduces: where torchvision is
    installed the default is its fast backend, whose resize differs by one intensity level on a few pixels."""
    return transformers.AutoProcessor.from_pretrained(model_dir, use_fast=False)


def hf_messages(record, image_dir):
    """The record as HF's processor reads it: content parts, each image part carrying its file."""
    messages = record.get("messages") or [{"role": "user", "content": record["query"]},
                                          {"role": "assistant", "content": record["response"]}]
    files = iter(record.get("images", []))
    strings_only = all(isinstance(m["content"], str) for m in messages)
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    out = []
    for i, m in enumerate(messages):
        content = m["content"]
        if strings_only and record.get("images") and i == first_user:  # llama32's layout: images open the turn
            content = [{"type": "image"}] * len(record["images"]) + [{"type": "text", "text": content}]
        if isinstance(content, list):  # a part's own path is relative to the data file, beside img/
            content = [p if p["type"] != "image" else
                       {"type": "image", "path": str(image_dir.parent / p["path"] if "path" in p
                                                     else image_dir / next(files))} for p in content]
        out.append({"role": m["role"], "content": content})
    return out


def hf_inputs(processor, record, image_dir):
    """(model inputs, labels) from HF's apply_chat_template: labels are the tokens after the generation prompt."""
    messages = hf_messages(record, image_dir)
    kw = dict(tokenize=True, return_dict=True, return_tensors="pt")
    full = processor.apply_chat_template(messages, **kw)
    prompt = processor.apply_chat_template(messages[:-1], add_generation_prompt=True, **kw)["input_ids"][0]
    ids = full["input_ids"][0]
    assert torch.equal(ids[:len(prompt)], prompt)
    labels = ids.clone()
    labels[:len(prompt)] = -100
    inputs = {k: v for k, v in full.items() if k != "attention_mask"}
    return inputs, labels[None]


def records_for(data_dir):
    return [{**r, "images": [f"img/{f}" for f in r["images"]]} if "images" in r else r for r in RECORDS]


def init_adapter(model, path, seed=1, targets=TEXT_REGEX):
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                       target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))  # B = 0 would make dL/dA zero
    model.save_pretrained(path)
    return model


def merged_logits(model_dir, adapter_dir, image):
    """(prompt ids, last logits [V]) of refimpl with the adapter merged as `generate --lora` merges it, on the chat
    prompt "what is it" with one image."""
    from refimpl.formats.checkpoint import load_checkpoint
    from refimpl.formats.lora import load_lora, merge_lora
    from refimpl.generate_vision import VisionEngine
    from refimpl.vision.prepare import prepare
    ckpt = load_checkpoint(model_dir)
    ckpt.params = merge_lora(ckpt.params, ckpt.config, load_lora(adapter_dir, ckpt.config))
    engine = VisionEngine(ckpt)
    req = prepare(model_dir, ckpt.config, ckpt.tokenizer, "what is it", [image], chat=True)
    n = len(req.prompt_ids)
    return req.prompt_ids, np.ravel(engine.logits(req.prompt_ids, np.arange(n), engine.new_cache(n),
                                                  images=req.images))


def finetune_args(model_dir, data, out, *extra):
    return ["finetune", "--model", model_dir, "--data", data, "--out", out, "--device", "cpu", "--dtype", "fp32",
            *map(str, extra)]


def test_samples_match_hf_processor(base):
    from refimpl.text.tokenizer import TextTokenizer
    from refimpl.formats.vision_checkpoint import load_vision_checkpoint
    from refimpl.train.data import load_samples
    from refimpl.train.image_data import VisionData, image_record_encoder
    model_dir, data_dir = base
    ckpt = load_vision_checkpoint(model_dir)
    tok = TextTokenizer.from_dir(model_dir, ckpt.config)
    vd = VisionData.for_checkpoint(model_dir, ckpt.config, tok)
    path = write_jsonl(data_dir / "d.jsonl", records_for(data_dir) + [PATH_PARTS])
    samples = load_samples(path, tok, 128, None, image_record_encoder(path, tok, vd))
    processor = hf_processor(model_dir)
    assert len(samples) == len(RECORDS) + 1
    for record, sample in zip(RECORDS + [PATH_PARTS], samples):
        inputs, labels = hf_inputs(processor, record, data_dir / "img")
        assert sample.ids == inputs["input_ids"][0].tolist()
        assert sample.labels == labels[0].tolist()
        ours = vd.inputs(sample)
        if "pixel_values" not in inputs:
            assert ours is None
            continue
        np.testing.assert_allclose(ours.pixel_values, inputs["pixel_values"][0].numpy(), rtol=1e-6, atol=1e-6)
        assert ours.aspect_ratio_ids.tolist() == inputs["aspect_ratio_ids"][0].tolist()
        assert ours.aspect_ratio_mask.tolist() == inputs["aspect_ratio_mask"][0].tolist()
        assert ours.cross_attention_mask.tolist() == inputs["cross_attention_mask"][0].tolist()


def sgd_step_errors(base, tmp_path, device="cpu"):
    """One SGD step through the CLI and through HF + PEFT; per LoRA matrix: (|got - want|, |step|, |want|)."""
    model_dir, data_dir = base
    model = init_adapter(hf_model(model_dir), tmp_path / "init")
    data = write_jsonl(data_dir / "train.jsonl", records_for(data_dir))
    lr = 0.5
    # 4 samples = batch 2 × 2 micro-batches: image and text samples share micro-batches in some order
    result = run_cli(finetune_args(model_dir, data, tmp_path / "out", "--init-adapter", tmp_path / "init",
                                   "--optimizer", "sgd", "--max-steps", 1, "--lr", lr, "--batch-size", 2,
                                   "--grad-accum", 2, "--dropout", 0, "--json", "--device", device))
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]

    processor = hf_processor(model_dir)
    encoded = [hf_inputs(processor, r, data_dir / "img") for r in RECORDS]
    n_items = sum(int((labels[0, 1:] != -100).sum()) for _, labels in encoded)
    before = lora_tensors(model)
    loss = peft_sgd_step(model, [dict(inputs, labels=labels, num_items_in_batch=n_items)
                                 for inputs, labels in encoded], lr)
    want = lora_tensors(model)
    got = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert records[0]["loss"] == pytest.approx(loss, rel=1e-4)
    assert got.keys() == want.keys() and len(got) == 2 * 7 * 4  # A and B of 7 linears in 4 layers
    assert any(".cross_attn.k_proj." in k for k in got)
    return {key: (np.linalg.norm(got[key] - want[key]), np.linalg.norm(want[key] - before[key]),
                  np.linalg.norm(want[key])) for key in want}


def test_one_sgd_step_equals_hf_peft(base, tmp_path):
    for key, (err, step, size) in sgd_step_errors(base, tmp_path).items():
        assert step > 1e-3 * size, key  # the step really moves this matrix
        assert err <= 1e-4 * size and err <= 1e-3 * step, (key, err, step)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_sgd_step_on_cuda_equals_hf_peft(base, tmp_path):
    for key, (err, step, size) in sgd_step_errors(base, tmp_path, device="cuda").items():
        assert step > 1e-3 * size, key
        assert err <= 1e-2 * step, (key, err, step)  # TF32 dots in the attention kernels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_adamw_halves_loss_on_cuda(base, tmp_path):
    model_dir, data_dir = base
    data = write_jsonl(data_dir / "train-cuda.jsonl", records_for(data_dir))
    result = run_cli(finetune_args(model_dir, data, tmp_path / "out", "--device", "cuda", "--dtype", "bf16",
                                   "--max-steps", 30, "--lr", "1e-2", "--batch-size", 4, "--json"))
    assert result.exit_code == 0, result.output
    steps = [json.loads(line) for line in result.stdout.splitlines() if '"step"' in line]
    assert len(steps) == 30 and steps[-1]["loss"] < 0.5 * steps[0]["loss"], (steps[0], steps[-1])


def test_adamw_halves_loss_and_adapter_loads_in_peft_and_generate(base, tmp_path):
    model_dir, data_dir = base
    # two image samples (wide, tall): each step runs the frozen encoder on every image under the CPU interpreter,
    # so few steps at a larger rate (the one-step test above holds the gradients to PEFT's on every sample)
    data = write_jsonl(data_dir / "train2.jsonl", records_for(data_dir)[:2])
    out = tmp_path / "out"
    result = run_cli(finetune_args(model_dir, data, out, "--max-steps", 6, "--lr", "5e-2", "--batch-size", 2,
                                   "--rank", 4, "--alpha", 8, "--json"))
    assert result.exit_code == 0, result.output
    steps = [json.loads(line) for line in result.stdout.splitlines() if '"step"' in line]
    assert len(steps) == 6 and steps[-1]["loss"] < 0.5 * steps[0]["loss"], (steps[0], steps[-1])

    cfg = json.loads((out / "adapter_config.json").read_text())
    loaded = peft.PeftModel.from_pretrained(hf_model(model_dir), out).eval()
    adapted = {n.removeprefix("base_model.model.") for n, m in loaded.named_modules() if hasattr(m, "lora_A")}
    assert len(adapted) == 7 * 4 and not any("vision" in n or "projector" in n for n in adapted), cfg
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert {k: v.tolist() for k, v in lora_tensors(loaded).items()} == {k: v.tolist() for k, v in saved.items()}
    # B starts at zero: every adapted linear was trained, the cross layers' k/v (which read only the image) too
    untrained = [k for k, v in saved.items() if "lora_B" in k and not np.abs(v).max() > 0]
    assert not untrained and any(".cross_attn.k_proj.lora_B" in k for k in saved), untrained

    # the adapter as generate merges it: refimpl's logits equal PEFT's on an image prompt
    prompt_ids, ours = merged_logits(model_dir, out, data_dir / "img" / "wide.png")
    n_prompt = len(prompt_ids)
    inputs, _ = hf_inputs(hf_processor(model_dir),
                          {**RECORDS[0], "images": ["wide.png"]}, data_dir / "img")
    with torch.no_grad():
        want = loaded(**inputs).logits[0].numpy()
    assert prompt_ids == inputs["input_ids"][0, :n_prompt].tolist()
    np.testing.assert_allclose(ours, want[n_prompt - 1], rtol=1e-4, atol=1e-4)

    # `lora merge` bakes it into a checkpoint transformers loads, with PEFT's logits
    merged = run_cli(["lora", "merge", "--model", model_dir, "--adapter", out, "--out", tmp_path / "merged"])
    assert merged.exit_code == 0, merged.output
    with torch.no_grad():
        baked = hf_model(tmp_path / "merged")(**inputs).logits[0].numpy()
    np.testing.assert_allclose(baked, want, rtol=1e-4, atol=1e-4)

    # `generate --lora --image` uses the adapter: its greedy tokens are PEFT's
    with torch.no_grad():
        greedy = loaded.generate(**{k: v[:, :n_prompt] if k in ("input_ids", "cross_attention_mask") else v
                                    for k, v in inputs.items()}, max_new_tokens=4, do_sample=False)
    for backend, mode in (("refimpl", "merged"), ("refimpl", "unmerged"), ("accel", "merged")):
        gen = run_cli(["generate", "what is it", "--chat", "--model", model_dir, "--backend", backend, "--device",
                       "cpu", "--image", data_dir / "img" / "wide.png", "--lora", out, "--lora-mode", mode,
                       "--max-new-tokens", 4, "--json"])
        assert gen.exit_code == 0, gen.output
        record = json.loads(gen.stdout)
        assert record["prompt_ids"] == prompt_ids
        assert record["generated_ids"] == greedy[0, n_prompt:].tolist(), (backend, mode)


def bad_case(data_dir, name):
    wide, tall = "img/wide.png", "img/tall.png"
    user = {"role": "user", "content": "what"}
    answer = {"role": "assistant", "content": "it"}
    (data_dir / "img" / "notes.png").write_text("not an image")
    cases = {
        "missing image": ({"messages": [user, answer], "images": ["img/nope.png"]}, ["nope.png: not found"]),
        "unreadable image": ({"messages": [user, answer], "images": ["img/notes.png"]}, ["notes.png: not an image"]),
        "more images than tokens": ({"messages": [{"role": "user", "content": "a <|image|> b"}, answer],
                                     "images": [wide, tall]}, ["1 <|image|> token(s) but 2 image(s)"]),
        "fewer images than parts": ({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                                               {"type": "text", "text": "x"}]},
                                                  answer], "images": [wide]}, ["2 <|image|> token(s) but 1 image(s)"]),
        "image in the answer": ({"messages": [user, {"role": "assistant", "content": [{"type": "image"}]}],
                                 "images": [wide]}, ["assistant turn"]),
        "bad part": ({"messages": [{"role": "user", "content": [{"type": "video"}]}, answer]}, ["part 0"]),
        "image url": ({"messages": [{"role": "user", "content": [{"type": "image", "url": "http://x/a.png"}]},
                                    answer]}, ["part 0", "'url' is not read"]),
        "images not a list": ({"messages": [user, answer], "images": "img/wide.png"}, ["'images' must be a list"]),
    }
    return cases[name]


@pytest.mark.parametrize("case", ["missing image", "unreadable image", "more images than tokens",
                                  "fewer images than parts", "image in the answer", "bad part", "image url",
                                  "images not a list"])
def test_bad_image_data_is_one_clear_error(base, tmp_path, case):
    model_dir, data_dir = base
    record, expected = bad_case(data_dir, case)
    data = write_jsonl(data_dir / f"bad-{case.replace(' ', '-')}.jsonl", [records_for(data_dir)[0], record])
    result = run_cli(finetune_args(model_dir, data, tmp_path / "out"))
    assert_clean_error(result, f"{data.name}:2", *expected)
    assert not (tmp_path / "out").exists()


def test_images_for_a_text_only_checkpoint(base, tmp_path):
    from tools.debug.golden_record import DEFAULT_DIR
    _, data_dir = base
    data = write_jsonl(data_dir / "text-only.jsonl", records_for(data_dir)[:1])
    result = run_cli(finetune_args(DEFAULT_DIR / "toy-gqa", data, tmp_path / "out"))
    assert_clean_error(result, "text-only.jsonl:1", "image samples", "text-only")


def test_init_adapter_on_the_vision_tower_is_refused(base, tmp_path):
    model_dir, data_dir = base
    model = peft.get_peft_model(hf_model(model_dir), peft.LoraConfig(r=2, target_modules=["fc1"]))
    model.save_pretrained(tmp_path / "vision-adapter")
    data = write_jsonl(data_dir / "one.jsonl", records_for(data_dir)[:1])
    result = run_cli(finetune_args(model_dir, data, tmp_path / "out", "--init-adapter", tmp_path / "vision-adapter"))
    assert_clean_error(result, "vision-adapter", "vision_model", "text decoder")


def test_generate_merges_adapters_on_every_linear_as_peft_does(base, tmp_path):
    """PEFT's all-linear on Mllama adapts the vision tower and the projector too: merged, refimpl's logits on an
    image prompt are PEFT's."""
    from refimpl.formats.lora import load_lora
    from refimpl.formats.vision_checkpoint import load_vision_checkpoint
    model_dir, data_dir = base
    peft_model = init_adapter(hf_model(model_dir), tmp_path / "all", targets="all-linear").eval()
    adapter = load_lora(tmp_path / "all", load_vision_checkpoint(model_dir, with_tokenizer=False).config)
    assert len(adapter) == 53 and any(name.startswith("vision_model.") for name, *_ in adapter)
    prompt_ids, ours = merged_logits(model_dir, tmp_path / "all", data_dir / "img" / "tall.png")
    n = len(prompt_ids)
    processor = hf_processor(model_dir)
    inputs, _ = hf_inputs(processor, {**RECORDS[0], "images": ["tall.png"]}, data_dir / "img")
    with torch.no_grad():
        want = peft_model(**inputs).logits[0, n - 1].numpy()
        plain = hf_model(model_dir)(**inputs).logits[0, n - 1].numpy()
    assert np.abs(want - plain).max() > 1e-2  # the adapter changes the answer
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4)
    unmerged = run_cli(["generate", "what is it", "--model", model_dir, "--backend", "refimpl", "--image",
                        data_dir / "img" / "tall.png", "--lora", tmp_path / "all", "--lora-mode", "unmerged"])
    assert_clean_error(unmerged, "--lora-mode unmerged", "also adapts")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors run the kernel in the interpreter "
                    "only (on a CUDA machine the GPU step test covers it)")
def test_cross_attention_kernel_on_the_vision_masks():
    """The Triton FlashAttention (the interpreter on the CPU) with the cross layers' masks — a row seeing only its
    own image's tiles, a text row before the image seeing all its sample's tokens, a sample without images seeing
    nothing — matches the plain-torch attention the CPU trainer runs, forward and backward."""
    from accel.train.attention import attention_reference, flash_attention
    g = torch.Generator().manual_seed(0)
    B, T, N, H, K, E = 2, 7, 10, 4, 2, 16
    q, k, v = (torch.randn(B, L, n, E, generator=g, requires_grad=True) for L, n in ((T, H), (N, K), (N, K)))
    visible = torch.zeros(B, T, N, dtype=torch.bool)
    visible[0, :2] = True  # text before the image: every token of its sample
    visible[0, 2:, :5] = True  # after it: the image's real tiles only
    # sample 1 has no image: nothing visible, output and gradients 0
    do = torch.randn(B, T, H, E, generator=g)
    got, want = (attention(q, k, v, causal=False, mask=visible) for attention in (flash_attention,
                                                                                 attention_reference))
    grads = [torch.autograd.grad(o, (q, k, v), do) for o in (got, want)]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got[1].abs().max() == 0
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
