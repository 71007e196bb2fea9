"""attn_implementation="llama32" (accel.hf) inside HF transformers against transformers' own "sdpa" (the oracle).

CPU, under TRITON_INTERPRET=1, fp32: tiny LlamaForCausalLM (GQA, MQA, explicit head_dim, left padding) and a tiny
MllamaForConditionalGeneration with every gate nonzero (vision encoder pad x pad mask, cross-attention mask): logits
and every parameter gradient, greedy generate ids, cached decoding with queries aligned to the end of the keys, a
PEFT LoRA training step; the SDPA fallbacks and their one warning per reason. Each test also checks that the Triton
kernel ran (a spy on flash_attention) and that nothing fell back where nothing should.
GPU (skipped without CUDA): bf16 logits and gradients at a 1B-like shape against SDPA.
"""
import copy
import os
import warnings

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import accel.hf
from accel.hf import attention as hf_attention
from refimpl.compare import TOLERANCES
from tests._hf_tiny import assert_close, assert_no_worse, left_padded, llama, mllama_inputs
from tests._mllama_hf import IMAGE

BF16 = TOLERANCES["bf16"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def kernel_calls(monkeypatch):
    """Counts calls that reached the Triton attention; fallbacks reset so each test sees its own warnings."""
    accel.hf.register()
    accel.hf.reset_fallbacks()
    calls = []
    real = hf_attention.flash_attention

    def spy(q, k, v, causal, mask):
        calls.append((tuple(q.shape), tuple(k.shape), causal, mask is not None))
        return real(q, k, v, causal, mask)

    monkeypatch.setattr(hf_attention, "flash_attention", spy)
    return calls


def run(model, impl, **inputs):
    """(logits, {name: grad}) of one forward + backward of the LM loss under attention `impl`."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def assert_same_run(model, inputs, real_rows=None):
    want_logits, want_grads = run(model, "sdpa", **inputs)
    got_logits, got_grads = run(model, "llama32", **inputs)
    rows = real_rows if real_rows is not None else torch.ones(got_logits.shape[:2], dtype=torch.bool)
    assert_close("logits", got_logits[rows], want_logits[rows])
    assert got_grads.keys() == want_grads.keys()
    assert len(want_grads) == len([p for p in model.parameters() if p.requires_grad])
    for name in want_grads:
        assert_close(name, got_grads[name], want_grads[name])


LLAMA_CASES = {  # name: (heads, kv heads, head_dim, hidden, sequence lengths of the batch (left-padded to T))
    "gqa": (4, 2, None, 48, [11, 11]),
    "mqa": (4, 1, None, 48, [11, 11]),
    "head_dim_24": (4, 2, 24, 40, [11, 11]),
    "padding": (4, 2, None, 48, [11, 6]),
}


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama_logits_and_every_gradient_equal_sdpa(case, kernel_calls):
    heads, kv, head_dim, hidden, lengths = LLAMA_CASES[case]
    model = llama(heads, kv, head_dim, hidden).train()
    ids, mask = left_padded(lengths, 11)
    labels = ids.masked_fill(mask == 0, -100)
    assert_same_run(model, dict(input_ids=ids, attention_mask=mask, labels=labels), real_rows=mask.bool())
    E = head_dim or hidden // heads
    assert kernel_calls and all(q[2:] == (heads, E) and k[2] == kv for q, k, _, _ in kernel_calls)
    padded = min(lengths) < 11
    # no padding: no mask at all (the kernel's causal path); padding: the 4D mask, and the causal blocks skipped
    assert all(causal and has_mask == padded for _, _, causal, has_mask in kernel_calls)
    assert accel.hf.fallback_counts() == {}


def test_both_switches_select_the_kernel(tmp_path, kernel_calls):
    llama().save_pretrained(tmp_path)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert accel.hf.register() == "llama32" == accel.hf.register()  # idempotent
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="llama32")
    assert loaded.config._attn_implementation == "llama32"
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert len(kernel_calls) == 2  # one per layer
    model = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    with torch.no_grad():
        want = model(input_ids=ids).logits
        model.config._attn_implementation = "llama32"
        again = model(input_ids=ids).logits
    assert len(kernel_calls) == 4
    assert_close("logits", got, want)
    assert_close("logits", again, want)


def greedy(model, impl, ids, mask, n=6, context=torch.no_grad):
    model.set_attn_implementation(impl)
    with context():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])  # inference tensors: no version counter
def test_generate_with_left_padding_gives_sdpa_greedy_ids(context, kernel_calls):
    model = llama(kv_heads=1, layers=2, seed=3).eval()
    ids, mask = left_padded([7, 4], 7, seed=2)
    want = greedy(model, "sdpa", ids, mask, context=context)
    got = greedy(model, "llama32", ids, mask, context=context)
    assert got.tolist() == want.tolist()
    assert len(set(want[:, 7:].flatten().tolist())) > 2  # a model that repeats one token would prove little
    decode = [c for c in kernel_calls if c[0][1] == 1]
    assert decode and all(has_mask and not causal for _, _, causal, has_mask in decode)  # [B, 1, 1, S] padding
    assert accel.hf.fallback_counts() == {}


def test_cached_chunk_aligned_to_the_end_of_the_keys(kernel_calls):
    """A 4-token chunk after 6 cached tokens (no padding): transformers' bool mask aligns the chunk's queries to the
    end of the keys; equal to SDPA, and to the one-pass forward of all 10 tokens."""
    model = llama(seed=4).eval()
    ids = torch.randint(3, 64, (1, 10), generator=torch.Generator().manual_seed(5))
    out = {}
    for impl in ("sdpa", "llama32"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            first = model(input_ids=ids[:, :6], use_cache=True)
            out[impl] = model(input_ids=ids[:, 6:], past_key_values=first.past_key_values).logits
            whole = model(input_ids=ids).logits[:, 6:]
        assert_close(f"{impl} chunk vs whole", out[impl], whole)
    assert_close("chunk logits", out["llama32"], out["sdpa"])
    chunk = [c for c in kernel_calls if c[0][1] == 4 and c[1][1] == 10]
    assert len(chunk) == 2 and all(has_mask and not causal for _, _, causal, has_mask in chunk)


def test_mllama_logits_and_every_gradient_equal_sdpa(kernel_calls):
    model, kw = mllama_inputs()
    model.train()
    labels = kw["input_ids"].masked_fill(kw["input_ids"] == IMAGE, -100)
    assert_same_run(model, dict(kw, labels=labels))
    vision = [c for c in kernel_calls if c[0][1] == 4 * 8]  # 4 tiles x (5 patch tokens padded to 8)
    cross = [c for c in kernel_calls if c[0][1] == 9 and c[1][1] != 9]
    assert vision and all(has_mask and not causal for _, _, causal, has_mask in vision)
    assert cross and all(has_mask and not causal for _, _, causal, has_mask in cross)
    assert accel.hf.fallback_counts() == {}


def test_mllama_generate_with_an_image_gives_sdpa_greedy_ids(kernel_calls):
    model, kw = mllama_inputs(kv_heads=1)
    model.eval()
    out = {}
    for impl in ("sdpa", "llama32"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = model.generate(**kw, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=3)
    assert out["llama32"].tolist() == out["sdpa"].tolist()
    assert any(c[0][1] == 1 and c[1][1] == 2 * 5 for c in kernel_calls)  # cached cross-attention decode
    assert accel.hf.fallback_counts() == {}


def test_peft_lora_step_equals_sdpa(kernel_calls):
    peft = pytest.importorskip("peft")
    ids, mask = left_padded([9, 5], 9, seed=7)
    labels = ids.masked_fill(mask == 0, -100)
    after, losses = {}, {}
    for impl in ("sdpa", "llama32"):
        base = llama(kv_heads=2, seed=8)
        base.set_attn_implementation(impl)
        torch.manual_seed(9)  # LoRA's B starts at zero: one step makes it nonzero, the next loss sees it
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        model.train()
        losses[impl] = []
        for _ in range(2):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[impl].append(loss.detach())
        after[impl] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert after["llama32"].keys() == after["sdpa"].keys() and len(after["sdpa"]) == 16
    for name in after["sdpa"]:
        assert_close(name, after["llama32"][name], after["sdpa"][name])
    assert_close("losses", torch.stack(losses["llama32"]), torch.stack(losses["sdpa"]))
    assert kernel_calls and accel.hf.fallback_counts() == {}


def test_head_dim_256_falls_back_with_one_warning(kernel_calls):
    model = llama(heads=2, kv_heads=1, head_dim=256, hidden=32).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = model(input_ids=ids).logits
        model.set_attn_implementation("llama32")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [model(input_ids=ids).logits for _ in range(2)]
    ours = [w for w in caught if "llama32 attention" in str(w.message)]
    assert len(ours) == 1 and "head size 256" in str(ours[0].message)
    assert accel.hf.fallback_counts() == {"head size 256 > 128": 4}  # 2 layers x 2 forwards
    assert not kernel_calls
    for logits in got:
        assert torch.equal(logits, want)  # the same SDPA call


class _Module(torch.nn.Module):
    is_causal = False
    num_key_value_groups = 2


def qkv(B=2, H=4, K=2, T=5, S=7, E=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, E, generator=g), torch.randn(B, K, S, E, generator=g),
            torch.randn(B, K, S, E, generator=g))


def both(q, k, v, mask, **kw):
    got, _ = accel.hf.attention_forward(_Module(), q, k, v, mask, **kw)
    want, _ = sdpa_attention_forward(_Module(), q, k, v, mask, **kw)
    return got, want


def test_float_masks_of_zeros_and_min_run_the_kernel_with_scaling(kernel_calls):
    q, k, v = qkv()
    vis = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(1)) < 0.6
    vis[..., 0] = True  # every row sees a key
    for mask in (vis, torch.zeros(vis.shape).masked_fill(~vis, torch.finfo(torch.float32).min),
                 torch.zeros(vis.shape).masked_fill(~vis, float("-inf")), vis[:1].expand(2, -1, -1, -1)):
        got, want = both(q, k, v, mask, scaling=0.3)
        assert_close("out", got, want)
    assert len(kernel_calls) == 4 and accel.hf.fallback_counts() == {}


def test_the_models_own_scaling_reaches_the_kernel_without_a_product(monkeypatch):
    """Llama passes head_dim ** -0.5, which times sqrt(128) is 1 + 1 ulp: q goes to the kernel as the same memory,
    not multiplied by 1.0000000000000002 (an extra op each way per layer); another scale still multiplies."""
    seen = []
    monkeypatch.setattr(hf_attention, "flash_attention", lambda q, k, v, causal, mask: seen.append(q) or q)
    q, k = torch.randn(1, 2, 3, 128), torch.randn(1, 1, 3, 128)
    accel.hf.attention_forward(_Module(), q, k, k, None, scaling=128 ** -0.5)
    accel.hf.attention_forward(_Module(), q, k, k, None, scaling=0.3)
    assert seen[0].data_ptr() == q.data_ptr() and seen[1].data_ptr() != q.data_ptr()


@pytest.mark.parametrize("what", ["bias", "empty_row", "dropout", "per_head", "fp16"])
def test_what_the_kernel_cannot_take_falls_back_to_sdpa(what, kernel_calls):
    q, k, v = qkv(seed=2)
    mask, kw = None, {}
    if what == "bias":
        mask = torch.randn(2, 1, 5, 7, generator=torch.Generator().manual_seed(3))
    elif what == "empty_row":  # SDPA averages a row of finite minima; the kernel would output 0
        mask = torch.zeros(2, 1, 5, 7)
        mask[1, 0, 2] = torch.finfo(torch.float32).min
    elif what == "dropout":
        kw = dict(dropout=0.1)
    elif what == "fp16":
        q, k, v = (x.half() for x in (q, k, v))
    else:
        mask = torch.ones(2, 4, 5, 7, dtype=torch.bool)
    with pytest.warns(UserWarning, match="llama32 attention"):
        torch.manual_seed(0)
        got, _ = accel.hf.attention_forward(_Module(), q, k, v, mask, **kw)
    torch.manual_seed(0)
    want, _ = sdpa_attention_forward(_Module(), q, k, v, mask, **kw)
    assert torch.equal(got, want)
    assert not kernel_calls and sum(accel.hf.fallback_counts().values()) == 1


@cuda
@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the GPU kernels, not the interpreter")
def test_gpu_bf16_logits_and_grads_at_a_1b_like_shape(kernel_calls):
    """Llama 3.2 1B's attention shape (32 heads, 8 kv heads, head 64; 2 layers), 2 x 1024 tokens, one padded."""
    model = llama(heads=32, kv_heads=8, hidden=2048, layers=2, intermediate=8192).to("cuda", torch.bfloat16).train()
    ids, mask = left_padded([1024, 700], 1024, seed=1)
    ids, mask = ids.cuda(), mask.cuda()
    labels = ids.masked_fill(mask == 0, -100)
    reference = copy.deepcopy(model).float()  # the oracle both bf16 paths are held to
    for inputs in (dict(input_ids=ids[:1], labels=labels[:1]),
                   dict(input_ids=ids, attention_mask=mask, labels=labels)):
        ref_logits, ref_grads = run(reference, "sdpa", **inputs)
        want_logits, want_grads = run(model, "sdpa", **inputs)
        got_logits, got_grads = run(model, "llama32", **inputs)
        rows = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
        assert_close("logits", got_logits[rows], want_logits[rows], BF16)
        assert_no_worse("logits", got_logits[rows], want_logits[rows], ref_logits[rows])
        for name in want_grads:
            assert_no_worse(name, got_grads[name], want_grads[name], ref_grads[name])
    assert kernel_calls and accel.hf.fallback_counts() == {}
