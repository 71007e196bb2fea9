"""accel.hf.apply: a loaded HF Llama / Mllama model with its RMSNorm and SwiGLU MLP forwards swapped for the Triton
ones, against the same model unpatched (the oracle: HF's own forwards).

CPU, under TRITON_INTERPRET=1, fp32: logits and gradients of a PEFT LoRA model (frozen norms: the kernels' case) and
of full fine-tuning (trainable norms: HF's forward keeps the weight gradient), the tiny Mllama with an image, the
table by model_type, idempotence. A spy checks that the kernels ran.
"""
import copy

import pytest
import torch

import accel.hf
from accel.hf import patch
from tests._mllama_hf import IMAGE
from tests._hf_tiny import (assert_close, assert_no_worse, assert_same_step, cpu_interpreter, forward_backward,
                            hf_rope, kernel_calls, left_padded, llama, lora, mllama_inputs)  # noqa: F401


def assert_patch_keeps_the_run(model, inputs, rows=None):
    patched = copy.deepcopy(model)
    want_logits, want_grads = forward_backward(model, inputs)  # first: apply() replaces RoPE for both
    counts = accel.hf.apply(patched)
    got_logits, got_grads = forward_backward(patched, inputs)
    assert_same_step(got_logits, got_grads, want_logits, want_grads, rows)
    return counts


@cpu_interpreter
def test_lora_llama_logits_and_grads_equal_unpatched(kernel_calls):
    model = lora(llama(kv_heads=2, layers=2)).train()
    ids, mask = left_padded([9, 6], 9, seed=3)
    counts = assert_patch_keeps_the_run(model, dict(input_ids=ids, attention_mask=mask,
                                                    labels=ids.masked_fill(mask == 0, -100)), mask.bool())
    assert counts == {"rms_norm": 5, "swiglu": 2, "rope": 1}  # 2 norms a layer + the final one; 1 MLP a layer
    assert kernel_calls == {"rms_norm": 5, "swiglu_pair": 2, "rope_qk": 2}


@cpu_interpreter
def test_full_finetuning_keeps_the_norm_weight_gradient(kernel_calls):
    model = llama(kv_heads=1, layers=2, seed=2).train()
    ids = torch.randint(3, 64, (1, 8), generator=torch.Generator().manual_seed(4))
    assert_patch_keeps_the_run(model, dict(input_ids=ids, labels=ids))
    assert kernel_calls == {"rms_norm": 0, "swiglu_pair": 2, "rope_qk": 2}  # trainable norms run HF's forward
    with torch.no_grad():  # without gradients the norm kernel applies again
        want = model(input_ids=ids).logits
        model_p = copy.deepcopy(model)
        accel.hf.apply(model_p)
        assert_close("no-grad logits", model_p(input_ids=ids).logits, want)
    assert kernel_calls["rms_norm"] == 5


@cpu_interpreter
def test_lora_mllama_with_an_image_equals_unpatched(kernel_calls):
    model, kw = mllama_inputs()
    model = lora(model).train()
    counts = assert_patch_keeps_the_run(model, dict(kw, labels=kw["input_ids"].masked_fill(
        kw["input_ids"] == IMAGE, -100)))
    # 4 text layers (2 self, 2 cross): 2 norms each, + the final norm, + 2 (q, k) head norms per cross layer
    assert counts == {"rms_norm": 4 * 2 + 1 + 2 * 2, "swiglu": 4, "rope": 1, "frozen_vision": 1}
    assert kernel_calls["rms_norm"] > 0 and kernel_calls["swiglu_pair"] == 4 and kernel_calls["rope_qk"] == 2


def vision_output_records_grad(model):
    """-> a list that each forward of the model's vision tower appends to: whether its output records autograd."""
    seen = []
    model.get_base_model().model.vision_model.register_forward_hook(
        lambda m, args, out: seen.append(out.last_hidden_state.requires_grad))
    return seen


def test_frozen_vision_tower_keeps_no_autograd_state_and_the_gradients():
    """LoRA on the text decoder only, with gradient checkpointing as PEFT sets it up (enable_input_require_grads
    makes the vision patch embedding's output require a gradient): unpatched, the frozen tower records autograd;
    patched, its forward runs without, and every adapter's gradient is the unpatched run's. With an adapter in the
    tower, it records autograd again."""
    peft = pytest.importorskip("peft")
    model, kw = mllama_inputs()
    inputs = dict(kw, labels=kw["input_ids"].masked_fill(kw["input_ids"] == IMAGE, -100))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(1)
    text = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                                       target_modules=text)).train()
    patched = copy.deepcopy(model)
    seen, seen_patched = vision_output_records_grad(model), vision_output_records_grad(patched)
    want = forward_backward(model, inputs)
    assert accel.hf.apply(patched, rms_norm=False, swiglu=False, rope=False) == {"frozen_vision": 1}
    got = forward_backward(patched, inputs)
    assert seen == [True] and seen_patched == [False]
    assert_same_step(*got, *want, lora_only=True)
    assert any("cross_attn.k_proj.lora_" in n for n in want[1])  # the image's K/V projections do train

    patched.get_base_model().model.vision_model.patch_embedding.weight.requires_grad_(True)
    got = forward_backward(patched, inputs)
    assert seen_patched[-1] is True and "vision_model.patch_embedding.weight" in "".join(got[1])


def test_apply_is_idempotent_takes_flags_and_refuses_unknown_models():
    model = llama()
    from transformers.models.llama import modeling_llama
    hf_rope = modeling_llama.apply_rotary_pos_emb
    assert accel.hf.apply(model, swiglu=False, rope=False) == {"rms_norm": 5}
    assert modeling_llama.apply_rotary_pos_emb is hf_rope
    assert accel.hf.apply(model) == {"rms_norm": 0, "swiglu": 2, "rope": 1}
    assert accel.hf.apply(model) == {"rms_norm": 0, "swiglu": 0, "rope": 0}
    assert modeling_llama.apply_rotary_pos_emb.llama32_original is hf_rope
    assert accel.hf.revert(model) == 8 and accel.hf.revert(model) == 0
    assert all("forward" not in vars(m) for m in model.modules())
    assert modeling_llama.apply_rotary_pos_emb is hf_rope
    assert accel.hf.apply(model) == {"rms_norm": 5, "swiglu": 2, "rope": 1}
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        accel.hf.apply(_gpt2())


def test_revert_of_a_peft_model_with_every_flag():
    """PEFT's wrappers hand attribute lookups on to the model they wrap: revert() on the PeftModel must undo what
    apply() did below it (the causal LM's fused loss forward included) and nothing else."""
    model = lora(llama())
    counts = accel.hf.apply(model, fused_linear_cross_entropy=True, lora=True)
    assert counts["fused_linear_cross_entropy"] == 1 and counts["lora"] == 2 * 5 and counts["attention"] == 2
    assert accel.hf.revert(model) == sum(counts.values())
    assert all("forward" not in vars(m) for m in model.modules())


def test_what_is_derived_from_a_tensor_dies_with_it():
    """accel.hf.memo.PerTensor (the masks' and RoPE tables' memo): derived once per tensor and version; an entry
    goes when one of its tensors does, so a step's masks do not outlive it."""
    import weakref
    from accel.hf.memo import PerTensor
    memo, calls = PerTensor(keep=8), []
    cos, sin = torch.randn(4), torch.randn(4)
    value = memo.get((cos, sin), 1, lambda: calls.append(1) or cos * sin)
    assert memo.get((cos, sin), 1, lambda: calls.append(1)) is value and calls == [1]
    with torch.no_grad():
        cos.add_(1.0)  # a new version: derived again
    again = memo.get((cos, sin), 1, lambda: calls.append(2) or cos * sin)
    assert calls == [1, 2] and torch.equal(again, cos * sin) and len(memo) == 1
    kept = weakref.ref(again)
    del value, again
    assert kept() is not None and len(memo) == 1  # the memo holds it while cos and sin live
    del cos
    assert kept() is None and len(memo) == 0


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))


@cpu_interpreter
def test_patched_generate_with_left_padding_gives_the_same_greedy_ids(kernel_calls):
    """generate's position ids differ per sequence under left padding: RoPE tables [B, T, E], one row each."""
    model = llama(kv_heads=1, seed=5).eval()
    ids, mask = left_padded([8, 5], 8, seed=6)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=None,
              pad_token_id=0)
    with torch.no_grad():
        want = model.generate(**kw)
        accel.hf.apply(model)
        got = model.generate(**kw)
    assert got.tolist() == want.tolist() and len(set(want[:, 8:].flatten().tolist())) > 2
    assert kernel_calls["rope_qk"] == 2 * 5  # every step, prefill included, through the kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_patched_lora_llama_equals_unpatched(kernel_calls, monkeypatch):
    """A 1B-like shape (hidden 2048, MLP 8192, 32/8 heads of 64; 2 layers), 2 x 512 tokens, bf16, LoRA."""
    model = lora(llama(heads=32, kv_heads=8, hidden=2048, layers=2, intermediate=8192).to(torch.bfloat16))
    model = model.cuda().train()
    ids, mask = left_padded([512, 300], 512, seed=1)
    ids, mask = ids.cuda(), mask.cuda()
    inputs = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    ref_logits, ref_grads = forward_backward(copy.deepcopy(model).float(), inputs)  # the fp32 oracle
    want_logits, want_grads = forward_backward(model, inputs)
    accel.hf.apply(model)
    got_logits, got_grads = forward_backward(model, inputs)
    rows = mask.bool()
    assert_no_worse("logits", got_logits[rows], want_logits[rows], ref_logits[rows])
    for name in want_grads:
        assert_no_worse(name, got_grads[name], want_grads[name], ref_grads[name])
    assert kernel_calls["rms_norm"] and kernel_calls["swiglu_pair"] and kernel_calls["rope_qk"]
    accel.hf.apply(model, lora=True)  # the LoRA branch in bf16 too: still no worse than HF's bf16 run
    lora_logits, lora_grads = forward_backward(model, inputs)
    assert_no_worse("logits (lora)", lora_logits[rows], want_logits[rows], ref_logits[rows])
    for name in want_grads:
        assert_no_worse(f"{name} (lora)", lora_grads[name], want_grads[name], ref_grads[name])
    accel.hf.register()  # and under "llama32": q, k, v + RoPE as one Function as well
    model.base_model.model.set_attn_implementation("llama32")
    calls = []
    real = patch.lora_qkv_rope
    monkeypatch.setattr(patch, "lora_qkv_rope", lambda *a: calls.append(1) or real(*a))
    qkv_logits, qkv_grads = forward_backward(model, dict(inputs, use_cache=False))
    assert len(calls) == 2
    assert_no_worse("logits (llama32, lora)", qkv_logits[rows], want_logits[rows], ref_logits[rows])
    for name in want_grads:
        assert_no_worse(f"{name} (llama32, lora)", qkv_grads[name], want_grads[name], ref_grads[name])


def fused_loss_run(model, inputs):
    """(HF's loss and gradients, then the fused ones) of `model`, patched with only the fused loss in between."""
    want = model(**inputs)
    want.loss.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    counts = accel.hf.apply(model, rms_norm=False, swiglu=False, rope=False, fused_linear_cross_entropy=True,
                            frozen_vision=False)
    assert counts == {"fused_linear_cross_entropy": 1}
    got = model(**inputs)
    assert got.logits is None  # the point: the [T, V] logits never exist
    got.loss.backward()
    assert_close("loss", got.loss, want.loss)
    assert want_grads
    for name, grad in want_grads.items():
        assert_close(name, dict(model.named_parameters())[name].grad, grad)
    return want


@cpu_interpreter
def test_fused_linear_cross_entropy_gives_hf_loss_and_grads_without_logits():
    model = lora(llama(kv_heads=2, seed=6)).train()
    ids, mask = left_padded([9, 5], 9, seed=8)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    want = fused_loss_run(model, inputs)
    n = int((inputs["labels"][:, 1:] != -100).sum())
    summed = model(**inputs, num_items_in_batch=torch.tensor(2 * n)).loss  # HF's sum / num_items_in_batch
    assert_close("num_items_in_batch", summed, want.loss / 2)
    with torch.no_grad():  # no gradients: HF's forward, logits included
        assert model(**inputs).logits.shape == (2, 9, 64)


@cpu_interpreter
def test_fused_linear_cross_entropy_on_mllama_with_an_image():
    model, kw = mllama_inputs()
    fused_loss_run(lora(model).train(), dict(kw, labels=kw["input_ids"].masked_fill(kw["input_ids"] == IMAGE, -100)))
