"""Tiny HF models and inputs for the accel.hf tests (test_hf_attention.py, test_hf_patch.py), and the comparison
they share (refimpl/compare.py's tolerances, with a message that says where)."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

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
