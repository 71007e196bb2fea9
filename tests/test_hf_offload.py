"""accel.hf.apply(offload_checkpoints=True): gradient checkpointing with each decoder layer's input held on the host
until its backward (accel/hf/offload.py), against the same model checkpointing as HF does (the oracle).

CPU, fp32, PEFT LoRA with gradient checkpointing on: the loss, logits and every adapter gradient of tiny Llama and
Mllama (with an image) models equal the unpatched model's, with and without the other patches (those under Triton's
interpreter); dropout's masks are the same in the recompute; the Function's own cases (an input without a gradient,
tuple outputs, a keyword tensor that needs a gradient); revert() gives HF's function back. On CUDA: the same
gradients, and the layer inputs' bytes gone from the GPU after the forward.
"""
import copy
import functools
import os

import pytest
import torch

import accel.hf
from accel.hf import offload, patch
from tests._hf_tiny import assert_close, cpu_interpreter, hf_rope, left_padded, llama, mllama_inputs  # noqa: F401
from tests._mllama_hf import IMAGE

peft = pytest.importorskip("peft")

TEXT = r".*(language_model|model\.layers).*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"


def checkpointed_lora(model):
    """`model` with gradient checkpointing as HF sets it up (then PEFT), LoRA on every text linear, training."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                                      target_modules=TEXT)).train()


def step(model, inputs, seed=0):
    """-> loss, logits (None where the fused loss gives none) and every parameter gradient of one step."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), None if out.logits is None else out.logits.detach(), grads


def assert_same(got, want):
    assert_close("loss", got[0], want[0])
    if got[1] is not None:
        assert_close("logits", got[1], want[1])
    assert got[2].keys() == want[2].keys() and want[2] and all("lora_" in n for n in want[2])
    for name in want[2]:
        assert_close(name, got[2][name], want[2][name])


def llama_inputs(T=9):
    ids, mask = left_padded([T, T - 3], T, seed=3)
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def image_inputs(kw):
    return dict(kw, labels=kw["input_ids"].masked_fill(kw["input_ids"] == IMAGE, -100))


def offloaded_run(model, inputs, **flags):
    """(the unpatched step, the step with apply(offload_checkpoints=True, **flags), apply's counts, the host bytes'
    peak over the offloaded step)."""
    patched = copy.deepcopy(model)
    want = step(model, inputs)
    counts = accel.hf.apply(patched, offload_checkpoints=True, **flags)
    offload.reset_host_peak()
    got = step(patched, inputs)
    return want, got, counts, offload.host_bytes()


def test_offloaded_llama_lora_step_equals_hf_checkpointing():
    model = checkpointed_lora(llama(kv_heads=2, layers=3))
    inputs = llama_inputs()
    want, got, counts, host = offloaded_run(model, inputs, rms_norm=False, swiglu=False, rope=False)
    assert counts == {"offload_checkpoints": 3}
    assert_same(got, want)
    B, T = inputs["input_ids"].shape
    # the [B, T, D] fp32 inputs of layers 1 and 2, then none (layer 0's is the embedding output: an autograd leaf)
    assert host == {"current": 0, "peak": 2 * B * T * 48 * 4}


def test_offloaded_mllama_with_an_image_equals_hf_checkpointing():
    model, kw = mllama_inputs()
    model = checkpointed_lora(model)
    want, got, counts, host = offloaded_run(model, image_inputs(kw), rms_norm=False, swiglu=False, rope=False,
                                            frozen_vision=False)
    assert counts == {"offload_checkpoints": 4}  # 2 self-attention and 2 cross-attention layers; not the tower
    assert_same(got, want)
    assert any(".cross_attn.k_proj.lora_" in n for n in want[2])
    assert host["peak"] == 3 * kw["input_ids"].numel() * 64 * 4


@cpu_interpreter
def test_offloaded_llama_with_every_patch_equals_hf_checkpointing():
    model = checkpointed_lora(llama(kv_heads=2, layers=2))
    want, got, counts, _ = offloaded_run(model, llama_inputs(), fused_linear_cross_entropy=True, lora=True)
    assert counts["offload_checkpoints"] == 2 and counts["lora"] == 14 and counts["fused_linear_cross_entropy"] == 1
    assert_same(got, want)


@cpu_interpreter
def test_offloaded_mllama_with_every_patch_equals_hf_checkpointing():
    model, kw = mllama_inputs()
    model = checkpointed_lora(model)
    accel.hf.register()
    model.base_model.model.set_attn_implementation("llama32")
    want, got, counts, _ = offloaded_run(model, dict(image_inputs(kw), use_cache=False),
                                         fused_linear_cross_entropy=True, lora=True)
    assert counts["offload_checkpoints"] == 4 and counts["frozen_vision"] == 1 and counts["attention"] == 2
    assert_same(got, want)


def test_dropout_draws_the_same_masks_in_the_recompute():
    """Attention dropout in training: the recompute restores the forward's RNG state, as torch's checkpoint does
    (without it the backward would use other masks and the gradients would differ)."""
    model = checkpointed_lora(llama(kv_heads=2, layers=2, attention_dropout=0.3))
    model.base_model.model.set_attn_implementation("eager")
    inputs = llama_inputs()
    want, got, _, _ = offloaded_run(model, inputs, rms_norm=False, swiglu=False, rope=False)
    assert_same(got, want)
    model.eval()  # the masks do change the step: without dropout the loss is another
    assert not torch.allclose(step(model, inputs)[0], want[0])


def toy_layer(x, w, scale=None, extra=None):
    """A layer as HF's checkpointing calls it: x positional, the rest bound by keyword -> (y, None)."""
    y = torch.tanh(x @ w) * scale[0]
    return (y + extra if extra is not None else y), None


def test_checkpoint_function_cases():
    """An input without a gradient (the layer's weight still gets one), a tuple output with a None in it, a bound
    keyword tensor that needs a gradient: every gradient equals plain autograd's."""
    g = torch.Generator().manual_seed(0)
    x, w, extra = (torch.randn(3, 4, generator=g), torch.randn(4, 4, generator=g), torch.randn(3, 4, generator=g))
    scale = (torch.tensor(1.5),)
    for x_grad, extra_grad in ((False, False), (True, True), (False, True)):
        leaves = [t.clone().requires_grad_(need) for t, need in ((x, x_grad), (w, True), (extra, extra_grad))]
        want_out = toy_layer(leaves[0], leaves[1], scale=scale, extra=leaves[2])
        want = torch.autograd.grad(want_out[0].square().sum(), [t for t in leaves if t.requires_grad])
        leaves = [t.clone().requires_grad_(need) for t, need in ((x, x_grad), (w, True), (extra, extra_grad))]
        fn = functools.partial(toy_layer, w=leaves[1], scale=scale, extra=leaves[2])
        out = offload.checkpoint(fn, leaves[0])
        assert out[1] is None and out[0].requires_grad
        got = torch.autograd.grad(out[0].square().sum(), [t for t in leaves if t.requires_grad])
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close(f"grad {i} ({x_grad}, {extra_grad})", a, b)
    with torch.no_grad():  # no gradients: the layer just runs
        assert offload.checkpoint(functools.partial(toy_layer, w=w, scale=scale), x)[0].grad_fn is None


def test_a_second_backward_through_an_offloaded_layer_says_why():
    w = torch.randn(4, 4, requires_grad=True)
    out = offload.checkpoint(functools.partial(toy_layer, w=w, scale=(1.0,)), torch.randn(3, 4))[0].sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.backward()


def test_revert_gives_hf_its_checkpoint_function_back():
    model = checkpointed_lora(llama(layers=2))
    layers = model.base_model.model.model.layers
    hf_funcs = [layer._gradient_checkpointing_func for layer in layers]
    assert accel.hf.apply(model, offload_checkpoints=True)["offload_checkpoints"] == 2
    assert accel.hf.apply(model, offload_checkpoints=True)["offload_checkpoints"] == 0  # idempotent
    assert all(layer._gradient_checkpointing_func is offload.checkpoint for layer in layers)
    accel.hf.revert(model)
    assert [layer._gradient_checkpointing_func for layer in layers] == hf_funcs
    assert not any("llama32_checkpoint" in vars(layer) for layer in layers)
    plain = llama(layers=2)  # without gradient checkpointing there is nothing to offload
    assert accel.hf.apply(plain, offload_checkpoints=True)["offload_checkpoints"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_offload_keeps_the_gradients_and_frees_the_layer_inputs():
    """fp32 on CUDA, 4 layers, 2048 tokens of width 1024: the gradients equal HF checkpointing's, and right after
    the forward the GPU holds about 3 layer inputs' bytes less (the first layer's input, the embedding output that
    transformers' enable_input_require_grads makes an autograd leaf, stays)."""
    model = checkpointed_lora(llama(heads=8, kv_heads=2, hidden=1024, layers=4, intermediate=2048).cuda())
    ids = torch.randint(3, 64, (1, 2048), generator=torch.Generator().manual_seed(0)).cuda()
    inputs = dict(input_ids=ids, labels=ids)
    layer_bytes = ids.numel() * 1024 * 4

    def forward_allocated(m):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = m(**inputs)
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # the allocator frees the blocks whose copies have run
        return torch.cuda.memory_allocated() - before, out

    want = step(model, inputs)
    base, out = forward_allocated(model)
    del out
    patched = copy.deepcopy(model)
    accel.hf.apply(patched, rms_norm=False, swiglu=False, rope=False, offload_checkpoints=True)
    got = step(patched, inputs)
    assert_same(got, want)
    offloaded, out = forward_allocated(patched)
    del out
    saved = base - offloaded
    assert 0.9 * 3 * layer_bytes <= saved <= 1.1 * 3 * layer_bytes, (saved, layer_bytes)


def test_frozen_vision_encoders_keep_only_the_states_their_vision_model_reads():
    """apply(frozen_vision=True) on the tiny Mllama (3 local layers of which it reads outputs 0 and 2, 1 global
    layer): without autograd each encoder returns HF's tensors at the read indices and None at the others (the global
    one: none), and a LoRA step's loss, logits and every gradient are the unpatched model's; revert() undoes it."""
    model, kw = mllama_inputs()
    model = checkpointed_lora(model)
    vision = model.base_model.model.model.vision_model
    assert vision.intermediate_layers_indices == [0, 2] and len(vision.transformer.layers) == 3
    patched = copy.deepcopy(model)
    want = step(model, image_inputs(kw))
    assert accel.hf.apply(patched, rms_norm=False, swiglu=False, rope=False) == {"frozen_vision": 1}
    got = step(patched, image_inputs(kw))
    assert_same(got, want)
    p_vision = patched.base_model.model.model.vision_model
    assert p_vision.transformer.llama32_keep == {0, 2} and p_vision.global_transformer.llama32_keep == frozenset()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 8, vision.hidden_size, generator=g)
    for name, kept in (("transformer", (0, 2)), ("global_transformer", ())):
        with torch.no_grad():
            ref = getattr(vision, name)(x).hidden_states
            out = getattr(p_vision, name)(x)
        assert len(out.hidden_states) == len(ref)
        for i, (a, b) in enumerate(zip(out.hidden_states, ref)):
            if i in kept:
                assert_close(f"{name} state {i}", a, b)
            else:
                assert a is None
        assert_close(f"{name} last", out.last_hidden_state, ref[-1])
    with torch.enable_grad():  # with autograd HF's forward runs, every state kept
        assert all(t is not None for t in p_vision.transformer(x).hidden_states)
    accel.hf.revert(patched)
    assert "forward" not in vars(p_vision.transformer) and "llama32_keep" not in vars(p_vision.transformer)
