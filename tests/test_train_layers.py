"""The training path's layers: the grouped LoRA linear (fp64, plain torch) against lora_linear_backward; a decoder
layer with the Triton Functions, the hand-written-backward layer (accel/train/layer.py) and a gated cross-attention
layer, each against the same layer in plain torch under autograd (CPU, TRITON_INTERPRET=1, fp32, odd shapes; GPU:
bf16 at the 1B shapes, skipped without CUDA).
"""
import torch

from refimpl.train import grads

from accel.train.lora import adapted_linear, lora_group
from accel.train.layer import manual_layer
from accel.train.model import grouped_layer, layer_groups
from accel.vision.weights import CrossLayer

from tests._train_helpers import close, cuda, interpreted, np64, randn, rel_l2, tables


def test_grouped_lora_against_oracle():
    """A fused [q | k | v] linear with k not adapted and two ranks/scales: each module's gradients are the oracle's
    for its own slice (float64, plain torch)."""
    T, Din, outs = 5, 12, (8, 4, 4)
    x = randn(2, T, Din, seed=1, dtype=torch.float64).requires_grad_()
    w = randn(sum(outs), Din, seed=2, dtype=torch.float64)
    aq, bq = randn(3, Din, seed=3, dtype=torch.float64), randn(8, 3, seed=4, dtype=torch.float64)
    av, bv = randn(2, Din, seed=5, dtype=torch.float64), randn(4, 2, seed=6, dtype=torch.float64)
    for p in (aq, bq, av, bv):
        p.requires_grad_()
    d_out = randn(2, T, sum(outs), seed=7, dtype=torch.float64)
    group = lora_group(((aq, bq, 2.0), None, (av, bv, 0.5)), outs, torch.float64)
    y = adapted_linear(x, w, group)
    y.backward(d_out)

    xs, ws, dys = np64(x).reshape(-1, Din), np64(w), np64(d_out).reshape(-1, sum(outs))
    sl = {"q": slice(0, 8), "k": slice(8, 12), "v": slice(12, 16)}
    want_dx = dys[:, sl["k"]] @ ws[sl["k"]]  # k: the base only, [T, Dk] @ [Dk, Din]
    for name, a, b, scale in (("q", aq, bq, 2.0), ("v", av, bv, 0.5)):
        dx, da, db = grads.lora_linear_backward(xs, ws[sl[name]], np64(a), np64(b), scale, dys[:, sl[name]])
        want_y = xs @ ws[sl[name]].T + scale * (xs @ np64(a).T) @ np64(b).T
        close(y.reshape(-1, sum(outs))[:, sl[name]], want_y, f"y {name}")
        close(a.grad, da, f"dA {name}")
        close(b.grad, db, f"dB {name}")
        want_dx = want_dx + dx
    close(x.grad.reshape(-1, Din), want_dx, "dx")


def layer_inputs(B, T, D, H, K, E, Fi, rank, device="cpu", dtype=torch.float32):
    s = iter(range(100))
    mk = lambda *shape, scale=0.2: randn(*shape, seed=next(s), dtype=dtype, device=device, scale=scale)  # noqa
    weights = (1 + mk(D), mk((H + 2 * K) * E, D), mk(D, H * E), 1 + mk(D), mk(2 * Fi, D), mk(D, Fi))
    outs = [H * E, K * E, K * E, D, Fi, Fi, D]
    ins = [D, D, D, H * E, D, D, Fi]
    adapters = tuple(None if i == 1 else  # k_proj not adapted
                     (mk(rank, ins[i], scale=0.3).float().requires_grad_(),
                      mk(outs[i], rank, scale=0.3).float().requires_grad_(), 2.0)
                     for i in range(7))
    x = mk(B, T, D, scale=1.0).requires_grad_()
    cos, sin = tables(T, E, device)
    return x, cos, sin, weights, adapters


def outputs_and_grads(forward, x, adapters):
    """forward() -> y, backpropagated from a fixed random dY: [y, dX, then dA and dB of each adapted module]."""
    for t in [x] + [p for a in adapters if a is not None for p in a[:2]]:
        t.grad = None
    y = forward()
    y.backward(randn(*y.shape, seed=99, dtype=y.dtype, device=y.device))
    return [y, x.grad] + [p.grad for a in adapters if a is not None for p in a[:2]]


def assert_same_fp32(got, want):
    """Summation orders differ (fused vs unfused): fp32 rounding relative to each tensor's own scale."""
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-5 * float(w.detach().abs().max()), rtol=1e-4,
                                   msg=lambda m: f"tensor {i}: {m}")


def run_layer(kernels, x, cos, sin, weights, adapters, shape, dropout=0.0, seed=None):
    def forward():
        if seed is not None:
            torch.manual_seed(seed)  # the LoRA dropout masks
        return grouped_layer(x, cos, sin, weights, layer_groups(adapters, shape, x.dtype), shape, 1e-5, dropout,
                             kernels)
    return outputs_and_grads(forward, x, adapters)


@interpreted
def test_layer_with_kernels_equals_plain_torch():
    """One decoder layer (GQA 2, odd sizes) with the Triton Functions vs the torch ops: output, dX, every dA/dB."""
    shape = (4, 2, 16, 40)  # H, K, E, F
    inputs = layer_inputs(2, 5, 24, *shape, rank=3)
    want = run_layer(False, *inputs, shape)
    got = run_layer(True, *inputs, shape)
    assert_same_fp32(got, want)


def run_manual(x, cos, sin, weights, adapters, shape, dropout=0.0, seed=None):
    def forward():
        if seed is not None:
            torch.manual_seed(seed)
        return manual_layer(x, cos, sin, weights, layer_groups(adapters, shape, x.dtype), shape, 1e-5, dropout)
    return outputs_and_grads(forward, x, adapters)


@interpreted
def test_manual_layer_equals_autograd_layer():
    """The hand-written layer backward (accel/train/layer.py) vs autograd over the torch ops: output, dX, every
    adapted module's dA/dB (k_proj not adapted), GQA 2, two sequences."""
    shape = (4, 2, 16, 40)
    inputs = layer_inputs(2, 5, 24, *shape, rank=3)
    want = run_layer(False, *inputs, shape)
    got = run_manual(*inputs, shape)
    assert_same_fp32(got, want)


@interpreted
def test_manual_layer_with_lora_dropout_equals_autograd_layer():
    """LoRA dropout inside the hand-written layer: with the same RNG seed both layers draw the same masks (one per
    adapted module, on its lora_A input, as PEFT), and autograd over the masked torch forward is the oracle for
    the hand-written backward (the masks are redrawn from the saved RNG state in its recompute)."""
    shape = (4, 2, 16, 40)
    inputs = layer_inputs(2, 5, 24, *shape, rank=3)
    want = run_layer(False, *inputs, shape, dropout=0.4, seed=7)
    got = run_manual(*inputs, shape, dropout=0.4, seed=7)
    assert_same_fp32(got, want)
    plain = run_manual(*inputs, shape)
    for i in range(len(plain)):  # the masks change the output, dX and every dA / dB
        assert not torch.allclose(got[i], plain[i], rtol=1e-3, atol=1e-5), i


def test_dropout_masks_are_inverted_dropout():
    """Each mask is 0 with probability p, else 1/(1-p): x · mask is F.dropout(x, p)'s value for that draw."""
    from accel.train.lora import dropout_masks
    x = torch.ones(4000)
    m1, m2 = dropout_masks(x, 0.25, 2)
    assert torch.equal(m1.unique(), torch.tensor([0.0, 1 / 0.75])) and not torch.equal(m1, m2)
    assert abs(float((m1 == 0).float().mean()) - 0.25) < 0.03


def run_cross_layer(kernels, x, states, visible, has_image, weights, adapters, shape):
    from accel.train.vision_model import cross_layer
    H, K, E, Fi = shape
    aq, ak, av, ao, ag, au, ad = adapters
    groups = (*(lora_group((a,), (None,), x.dtype) for a in (aq, ak, av, ao)),
              lora_group((ag, au), (Fi, Fi), x.dtype), lora_group((ad,), (None,), x.dtype))
    return outputs_and_grads(lambda: cross_layer(x, states, visible, has_image, *weights, groups, (H, K, E), 1e-5,
                                                 0.0, kernels), x, adapters)


@interpreted
def test_cross_layer_with_kernels_equals_plain_torch():
    """A gated cross-attention layer (GQA 2, odd sizes, fused gate_up with LoRA on gate only) with the Triton norm
    and SwiGLU Functions vs the torch ops: output, dX, every dA/dB (a first row that sees no image included)."""
    B, T, N, D, (H, K, E, Fi) = 2, 5, 7, 24, (4, 2, 16, 40)
    s = iter(range(100))
    mk = lambda *shape, scale=0.2: randn(*shape, seed=next(s), scale=scale)  # noqa: E731
    gate = lambda: mk(1, scale=1.0).abs() + 0.3  # noqa: E731  (nonzero: a zero tanh gate hides the layer)
    attn_norm, q, k, v, o, q_norm, k_norm, attn_gate, mlp_norm, down, mlp_gate, gate_up = (
        1 + mk(D), mk(H * E, D), mk(K * E, D), mk(K * E, D), mk(D, H * E), 1 + mk(E), 1 + mk(E), gate(),
        1 + mk(D), mk(D, Fi), -gate(), mk(2 * Fi, D))
    layer = CrossLayer(attn_norm=attn_norm, q=q, q_norm=q_norm, o=o, attn_gate=attn_gate, mlp_norm=mlp_norm,
                       gate_up=gate_up, down=down, mlp_gate=mlp_gate)
    weights = (layer, (k, v, k_norm))
    outs, ins = [H * E, K * E, K * E, D, Fi, Fi, D], [D, D, D, H * E, D, D, Fi]
    adapters = tuple(None if i in (1, 5) else  # k_proj and up_proj not adapted
                     (mk(3, ins[i], scale=0.3).requires_grad_(), mk(outs[i], 3, scale=0.3).requires_grad_(), 2.0)
                     for i in range(7))
    x, states = mk(B, T, D, scale=1.0).requires_grad_(), mk(B, N, D, scale=1.0)
    visible = randn(B, T, N, seed=50) > 0
    visible[:, 0] = False  # text before the image
    has_image = visible.any(-1, keepdim=True).float()
    args = (x, states, visible | ~visible.any(-1, keepdim=True), has_image, weights, adapters, (H, K, E, Fi))
    want = run_cross_layer(False, *args)
    got = run_cross_layer(True, *args)
    assert_same_fp32(got, want)


# --- GPU, bf16 at the real shapes ---------------------------------------------------------------------------------

@cuda
def test_gpu_bf16_layer_with_kernels_equals_plain_torch():
    shape = (32, 8, 64, 8192)
    inputs = layer_inputs(1, 512, 2048, *shape, rank=16, device="cuda", dtype=torch.bfloat16)
    want = run_layer(False, *inputs, shape)
    got = run_layer(True, *inputs, shape)
    for i, (g, w) in enumerate(zip(got, want)):
        assert rel_l2(g, w) < 2e-2, (i, rel_l2(g, w))


@cuda
def test_gpu_bf16_manual_layer_equals_autograd_layer():
    shape = (32, 8, 64, 8192)
    inputs = layer_inputs(1, 512, 2048, *shape, rank=16, device="cuda", dtype=torch.bfloat16)
    want = run_layer(False, *inputs, shape)
    got = run_manual(*inputs, shape)
    for i, (g, w) in enumerate(zip(got, want)):
        assert rel_l2(g, w) < 2e-2, (i, rel_l2(g, w))


@cuda
def test_gpu_bf16_manual_layer_with_dropout_equals_autograd_layer():
    shape = (32, 8, 64, 8192)
    inputs = layer_inputs(1, 512, 2048, *shape, rank=16, device="cuda", dtype=torch.bfloat16)
    want = run_layer(False, *inputs, shape, dropout=0.05, seed=3)
    got = run_manual(*inputs, shape, dropout=0.05, seed=3)
    for i, (g, w) in enumerate(zip(got, want)):
        assert rel_l2(g, w) < 2e-2, (i, rel_l2(g, w))
