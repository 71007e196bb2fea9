"""accel.hf.apply(lora=True): PEFT's LoRA linears, each MLP and (under "llama32") each self-attention's q, k, v +
RoPE as one autograd Function each (accel/hf/lora.py, mlp.py, qkv.py), against PEFT's own forward on the same
model (the oracle).

CPU, fp32 (the kernels under TRITON_INTERPRET=1): logits and every LoRA gradient of tiny Llama and Mllama (with an
image) models, GQA and padding; the Function's backward against finite differences; what it leaves to PEFT; the
lifetime of the adapters' casts.
"""
import pytest
import torch

import accel.hf
from accel.hf import lora as lora_module
from accel.hf import patch
from tests._mllama_hf import IMAGE
from tests._hf_tiny import (assert_close, assert_same_step, cpu_interpreter, forward_backward, hf_rope,  # noqa: F401
                            kernel_calls, left_padded, llama, lora, mllama_inputs)


def test_lora_branch_in_the_activations_dtype_equals_peft_in_fp32(monkeypatch):
    """apply(lora=True) alone: PEFT's LoRA linears as one autograd Function (accel/hf/lora.py); in fp32 (no casts)
    the same logits and LoRA gradients as PEFT's own forward; revert() gives PEFT's forward back. Runs anywhere
    (torch ops)."""
    model = lora(llama(kv_heads=2, seed=7)).train()
    ids, mask = left_padded([9, 6], 9, seed=9)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    want_logits, want_grads = forward_backward(model, inputs)
    counts = accel.hf.apply(model, rms_norm=False, swiglu=False, rope=False, lora=True)
    assert counts == {"lora": 2 * 5}  # q, v, gate, up, down in each of 2 layers
    calls = []
    real = lora_module.lora_linear
    monkeypatch.setattr(lora_module, "lora_linear", lambda *a: calls.append(1) or real(*a))
    got_logits, got_grads = forward_backward(model, inputs)
    assert len(calls) == 10  # every LoRA linear took the patched forward
    assert_same_step(got_logits, got_grads, want_logits, want_grads, mask.bool(), lora_only=True)
    assert accel.hf.revert(model) == 10 and all("forward" not in vars(m) for m in model.modules())


@cpu_interpreter
@pytest.mark.parametrize("targets", [["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                                     ["gate_proj", "down_proj"]])
def test_lora_mlp_as_one_function_equals_peft(targets, kernel_calls, monkeypatch):
    """apply(lora=True) with the SwiGLU patch: the MLP (its LoRA linears, plain frozen ones among them, and the
    SwiGLU kernel) as one Function (accel/hf/mlp.py); fp32 logits and every LoRA gradient equal PEFT's unpatched."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    model = peft.get_peft_model(llama(kv_heads=2, layers=2, seed=4), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=targets)).train()
    ids, mask = left_padded([9, 6], 9, seed=5)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    want_logits, want_grads = forward_backward(model, inputs)
    accel.hf.apply(model, lora=True)
    calls = []
    real = patch.lora_swiglu_mlp
    monkeypatch.setattr(patch, "lora_swiglu_mlp", lambda *a: calls.append(1) or real(*a))
    got_logits, got_grads = forward_backward(model, inputs)
    assert len(calls) == 2  # each layer's MLP
    assert_same_step(got_logits, got_grads, want_logits, want_grads, mask.bool(), lora_only=True)


@cpu_interpreter
@pytest.mark.parametrize("targets", [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                     ["q_proj", "v_proj"]])
def test_lora_qkv_rope_as_one_function_equals_peft_sdpa(targets, monkeypatch):
    """apply(lora=True) under "llama32": each self-attention's q, k, v (LoRA or plain frozen) and RoPE as one
    Function (accel/hf/qkv.py); fp32 logits and every LoRA gradient equal the unpatched PEFT model's under SDPA,
    GQA and padding included."""
    peft = pytest.importorskip("peft")
    accel.hf.register()
    torch.manual_seed(1)
    model = peft.get_peft_model(llama(kv_heads=2, layers=2, seed=8), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=targets)).train()
    model.base_model.model.set_attn_implementation("sdpa")
    ids, mask = left_padded([9, 6], 9, seed=6)
    # no cache, as under gradient checkpointing (with one, HF's forward runs: its cache update is HF's)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False)
    want_logits, want_grads = forward_backward(model, inputs)
    model.base_model.model.set_attn_implementation("llama32")
    counts = accel.hf.apply(model, lora=True)
    assert counts["attention"] == 2
    calls = []
    real = patch.lora_qkv_rope
    monkeypatch.setattr(patch, "lora_qkv_rope", lambda *a: calls.append(1) or real(*a))
    got_logits, got_grads = forward_backward(model, inputs)
    assert len(calls) == 2  # each layer's self-attention
    assert_same_step(got_logits, got_grads, want_logits, want_grads, mask.bool(), lora_only=True)


@cpu_interpreter
def test_lora_functions_on_mllama_with_an_image_equal_peft_sdpa(monkeypatch):
    """apply(lora=True) on the tiny Mllama under "llama32": the text self-attentions' q, k, v + RoPE and the MLPs
    as Functions (the cross-attention layers keep HF's forward around the LoRA linears); logits and gradients are
    the unpatched PEFT model's under SDPA."""
    model, kw = mllama_inputs()
    model = lora(model).train()
    model.base_model.model.set_attn_implementation("sdpa")
    inputs = dict(kw, labels=kw["input_ids"].masked_fill(kw["input_ids"] == IMAGE, -100), use_cache=False)
    want_logits, want_grads = forward_backward(model, inputs)
    accel.hf.register()
    model.base_model.model.set_attn_implementation("llama32")
    calls = {"qkv": 0, "mlp": 0}
    for name, fn in (("qkv", "lora_qkv_rope"), ("mlp", "lora_swiglu_mlp")):
        real = getattr(patch, fn)
        monkeypatch.setattr(patch, fn, lambda *a, _real=real, _name=name: calls.__setitem__(
            _name, calls[_name] + 1) or _real(*a))
    assert accel.hf.apply(model, lora=True)["attention"] == 2  # the 2 self-attention layers
    got_logits, got_grads = forward_backward(model, inputs)
    assert calls == {"qkv": 2, "mlp": 4}
    assert_same_step(got_logits, got_grads, want_logits, want_grads)


def test_lora_linear_gradients_equal_finite_differences():
    """The Function's written-out backward against numerical differentiation (fp64), a base bias, 3D input."""
    g = torch.Generator().manual_seed(3)
    x, w, bias = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((2, 3, 6), (5, 6), (5,)))
    a, b = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    x.requires_grad_(), a.requires_grad_(), b.requires_grad_()
    assert torch.autograd.gradcheck(lambda x, a, b: lora_module.lora_linear(x, w, bias, a, b, 0.7), (x, a, b))
    want = x @ w.t() + bias + 0.7 * (x @ a.t()) @ b.t()
    assert_close("y", lora_module.lora_linear(x, w, bias, a, b, 0.7), want)


def test_lora_forward_leaves_what_it_does_not_cover_to_peft(monkeypatch):
    """A bias on lora_B (lora_bias=True) or a trainable base weight: PEFT's own forward, the same answers."""
    peft = pytest.importorskip("peft")
    calls = []
    real = lora_module.lora_linear
    monkeypatch.setattr(lora_module, "lora_linear", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    for kw in (dict(lora_bias=True), dict()):
        model = peft.get_peft_model(llama(kv_heads=2, seed=5), peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=["q_proj"], **kw))
        if not kw:
            model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.requires_grad_(True)
        want = model(input_ids=ids).logits
        accel.hf.apply(model, rms_norm=False, swiglu=False, rope=False, lora=True)
        assert_close("logits", model(input_ids=ids).logits, want)
        assert len(calls) == (0 if kw else 1)  # layer 1's q_proj (frozen base) still takes the Function


def test_adapter_casts_live_from_the_recompute_to_the_backward():
    """The bf16 casts of A and B in a training step with gradient checkpointing: the forward's call casts and keeps
    nothing, the recompute's cast is kept and shared with the backward, whose call (last) drops it; an in-place
    update of either adapter (the optimizer's step) gives a fresh cast; adapters already in the activations' dtype
    are not cast."""
    import weakref
    a, b = torch.randn(4, 6), torch.randn(5, 4)
    forward = lora_module.casts(a, b, torch.bfloat16)
    assert forward[0].dtype == torch.bfloat16 and torch.equal(forward[1], b.to(torch.bfloat16))
    kept_forward = weakref.ref(forward[0])
    del forward
    assert kept_forward() is None  # not kept
    recompute = lora_module.casts(a, b, torch.bfloat16)
    assert lora_module.casts(a, b, torch.bfloat16) is recompute  # kept
    assert lora_module.casts(a, b, torch.bfloat16, last=True) is recompute
    kept = weakref.ref(recompute[0])
    del recompute
    assert kept() is None  # nothing kept to the next step
    lora_module.casts(a, b, torch.bfloat16), lora_module.casts(a, b, torch.bfloat16)
    with torch.no_grad():
        b.add_(1.0)
    fresh = lora_module.casts(a, b, torch.bfloat16)
    assert torch.equal(fresh[1], b.to(torch.bfloat16)) and lora_module.casts(a, b, torch.bfloat16) is not fresh
    same = lora_module.casts(a, b, torch.float32)
    assert same[0] is a and same[1] is b
