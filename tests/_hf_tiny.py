"""Tiny HF models and inputs for the accel.hf tests (test_hf_attention.py, test_hf_patch.py, test_hf_lora.py,
test_hf_offload.py), the comparison they share (refimpl/compare.py's tolerances, with a message that says where),
and the patch tests' fixtures and training step."""
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from accel.hf import patch
from refimpl.compare import TOLERANCES, compare
from tests._mllama_hf import IMAGE, cross_mask, hf_model, image_arrays

FP32 = TOLERANCES["fp32"]


def assert_close(name, got, ref, tol=FP32):
    c = compare(name, got.detach().float().cpu().numpy(), ref.detach().float().cpu().numpy(), tol)
    assert c.ok, (f"{name}: max_abs {c.max_abs:.3g} (ref max {c.ref_max:.3g}) nmse {c.nmse:.3g} at {c.worst} "
                  f"{c.problem}")


def assert_no_worse(name, got, base, ref, factor=2.0):
    """bf16 against bf16: `got`'s error from the fp32 reference `ref` is at most `factor` times `base`'s (HF's own
    bf16 run), in NMSE and in the largest difference — two bf16 paths round differently, so each is held to the
    higher-precision oracle rather than to the other."""
    got_c, base_c = (compare(name, x.detach().float().cpu().numpy(), ref.detach().float().cpu().numpy(),
                             TOLERANCES["fp32"]) for x in (got, base))
    assert got_c.nmse <= factor * base_c.nmse + 1e-12 and got_c.max_abs <= factor * base_c.max_abs + 1e-12, (
        f"{name}: nmse {got_c.nmse:.3g} vs HF bf16's {base_c.nmse:.3g}, max_abs {got_c.max_abs:.3g} vs "
        f"{base_c.max_abs:.3g} (from the fp32 reference), worst at {got_c.worst}")


def llama(heads=4, kv_heads=2, head_dim=None, hidden=48, layers=2, seed=0, intermediate=64, **kw):
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      initializer_range=0.2, **kw)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def left_padded(lengths, T, seed=0, vocab=64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(lengths), T), generator=g)
    mask = (torch.arange(T)[None, :] >= T - torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def mllama_inputs(kv_heads=2):
    model = hf_model(kv_heads=kv_heads)
    ids = [1, 5, 6, IMAGE, 9, 11, 13, 4, 7]  # text before the image sees none of it
    pixels, ar_ids, ar_mask = image_arrays([(1, 2)], seed=1)
    xmask = cross_mask(ids, [2])
    kw = dict(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(pixels)[None],
              aspect_ratio_ids=torch.from_numpy(ar_ids)[None], aspect_ratio_mask=torch.from_numpy(ar_mask)[None],
              cross_attention_mask=torch.from_numpy(xmask)[None])
    return model, kw


# The patch runs llama32's kernels on CUDA tensors, or on CPU tensors under Triton's interpreter; on a CUDA machine
# the tiny CPU models would take HF's own forwards, so there test_hf_patch.py's GPU test is the coverage.
cpu_interpreter = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                     reason="CPU-interpreter coverage; the GPU's is test_gpu_bf16_patched_lora_*")


@pytest.fixture(autouse=True)
def hf_rope():
    """RoPE is patched in the modeling files, process-wide: every test leaves HF's own behind."""
    yield
    for module_name in {t["rope"] for t in patch.PATCHES.values()}:
        patch.unpatch_rope(module_name)


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = {"rms_norm": 0, "swiglu_pair": 0, "rope_qk": 0}
    for name in calls:
        real = getattr(patch.fused, name)

        def spy(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(patch.fused, name, spy)
    return calls


def lora(model):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                                       target_modules=["q_proj", "v_proj", "gate_proj", "up_proj",
                                                                       "down_proj"]))
    return model


def forward_backward(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(got_logits, got_grads, want_logits, want_grads, rows=None, lora_only=False):
    """The patched step's logits (at `rows`, default all) and every gradient equal the reference's; lora_only:
    the trainable parameters are the adapters' alone."""
    rows = rows if rows is not None else torch.ones(got_logits.shape[:2], dtype=torch.bool)
    assert_close("logits", got_logits[rows], want_logits[rows])
    assert got_grads.keys() == want_grads.keys() and want_grads
    assert not lora_only or all("lora_" in n for n in want_grads)
    for name in want_grads:
        assert_close(name, got_grads[name], want_grads[name])
