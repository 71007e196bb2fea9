"""accel's quantized GEMVs, dequantize and engine on CUDA (skipped without it) at the Llama 3.2 shapes in bf16,
against float64 or the oracle (refimpl.quant); tests/test_quant_accel.py has the CPU-interpreter coverage and the
device repeats of its bit checks."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from accel.engine import AccelEngine  # noqa: E402
from accel.kernels.qgemv import QGemvConfig  # noqa: E402
from accel.quant_ops import from_quantized_linear, quantize  # noqa: E402
from refimpl.compare import TOLERANCES, compare  # noqa: E402
from refimpl.formats.params import Checkpoint, random_params  # noqa: E402
from refimpl.generate import RefEngine, Sampling  # noqa: E402
from refimpl.quant.apply import quantize_params  # noqa: E402
from refimpl.quant.schemes import QuantSpec  # noqa: E402
from test_gguf import tiny_config  # noqa: E402
from test_quant_accel import bits, gguf_record, gpu, oracle_product  # noqa: E402
from tests._logits import NOISE, near_tie, rms  # noqa: E402


@gpu
@pytest.mark.parametrize("spec", ["int8", "int4:32", "int4:64", "int4:128"])
@pytest.mark.parametrize("N, K, fusion", [(3072, 2048, "norm"), (2048, 2048, "residual"), (16384, 2048, "norm"),
                                          (2048, 8192, "swiglu"), (128256, 2048, "norm"), (5120, 3072, "norm"),
                                          (3072, 3072, "residual"), (16384, 3072, "norm"), (3072, 8192, "swiglu"),
                                          (128256, 3072, "norm")])
def test_quantized_gemv_at_llama_shapes_gpu(spec, N, K, fusion):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(N, K, device="cuda", generator=g) * 0.02
    t = quantize(w, QuantSpec.parse(spec))
    x = torch.randn(1, 2 * K if fusion == "swiglu" else K, device="cuda", generator=g).to(torch.bfloat16)
    r = torch.randn(1, N, device="cuda", generator=g).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(K, device="cuda", generator=g)).to(torch.bfloat16)
    from accel.ops.torch_ops import torch_rms_norm, torch_swiglu_gate_up
    kw, fx = {}, x
    if fusion == "norm":
        kw, fx = dict(norm_weight=nw, eps=1e-5), torch_rms_norm(x, nw, 1e-5)
    elif fusion == "swiglu":
        kw, fx = dict(swiglu=True), torch_swiglu_gate_up(x)
    elif fusion == "residual":
        kw = dict(residual=r.clone())
    got = t.gemv(x, **kw).float()
    want = fx.double() @ t.dequantize().double().T + (r.double() if fusion == "residual" else 0)
    # bf16 output: one rounding of the result (and of the residual sum), 2^-8 relative
    err = (got.double() - want).abs().max().item()
    assert err <= 2 ** -7 * want.abs().max().item() + 1e-3, err


@gpu
@pytest.mark.parametrize("spec", ["int4:32", "int4:64"])
@pytest.mark.parametrize("N, K, fusion, bn, warps, programs", [
    (16384, 2048, "norm", 16, 2, 264), (2048, 2048, "residual", 32, 4, 28), (2048, 8192, "residual", 8, 4, 100),
    (128256, 3072, "norm", 16, 4, 264), (3072, 3072, "residual", 8, 2, 264)])
def test_persistent_quantized_gemv_at_llama_shapes_gpu(spec, N, K, fusion, bn, warps, programs):
    """Persistent configs (QGemvConfig.programs: fewer programs than row blocks, one tile a row, the scale lines
    of each next block prefetched) against float64, bf16 tolerance; every case loops over >= 2 rounds of row blocks
    with a ragged last round."""
    blocks = -(-N // bn)
    assert blocks > programs and blocks % programs, (blocks, programs)  # the case itself: rounds, not one pass
    g = torch.Generator(device="cuda").manual_seed(1)
    t = quantize(torch.randn(N, K, device="cuda", generator=g) * 0.02, QuantSpec.parse(spec))
    x = torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16)
    r = torch.randn(1, N, device="cuda", generator=g).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(K, device="cuda", generator=g)).to(torch.bfloat16)
    from accel.ops.torch_ops import torch_rms_norm
    kw, fx = (dict(norm_weight=nw, eps=1e-5), torch_rms_norm(x, nw, 1e-5)) if fusion == "norm" else \
        (dict(residual=r.clone()), x)
    cfg = QGemvConfig(bn, 1 << (K - 1).bit_length(), warps, 1, 3, programs)
    got = t.gemv(x, config=cfg, **kw).float()
    want = fx.double() @ t.dequantize().double().T + (r.double() if fusion == "residual" else 0)
    err = (got.double() - want).abs().max().item()
    assert err <= 2 ** -7 * want.abs().max().item() + 1e-3, err


@gpu
@pytest.mark.parametrize("spec", ["int8", "int4:64"])
@pytest.mark.parametrize("H, NKV, E, D", [(32, 8, 64, 2048), (24, 8, 128, 3072)])
def test_quantized_qkv_rope_at_llama_shapes_gpu(spec, H, NKV, E, D):
    """The fused quantized norm + qkv + RoPE + cache write against float64: dequantized weight, rms_norm, rope."""
    from accel.kernels.qgemv_fused import qkv_rope_qfwd
    from accel.ops.torch_ops import torch_rms_norm
    g = torch.Generator(device="cuda").manual_seed(0)
    N, S, pos = (H + 2 * NKV) * E, 32, 17
    t = quantize(torch.randn(N, D, device="cuda", generator=g) * 0.02, QuantSpec.parse(spec))
    x = torch.randn(1, D, device="cuda", generator=g).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
    ang = torch.randn(S, E // 2, device="cuda", generator=g)
    cos, sin = ang.cos(), ang.sin()
    ck = torch.zeros(NKV, S, E, device="cuda", dtype=torch.bfloat16)
    cv = torch.zeros_like(ck)
    got_q = qkv_rope_qfwd(t.q, t.scale, t.low, t.bits, t.offset, t.group, t.K, x, nw, 1e-5, cos, sin,
                          torch.tensor([pos], device="cuda"), ck, cv)
    qkv = (torch_rms_norm(x, nw, 1e-5).double() @ t.dequantize().double().T)[0]  # [(H+2K)·E]
    c, s = cos[pos].double(), sin[pos].double()

    def rope64(a):  # [heads, E] float64
        a1, a2 = a[:, :E // 2], a[:, E // 2:]
        return torch.cat([a1 * c - a2 * s, a2 * c + a1 * s], dim=1)
    want = [rope64(qkv[:H * E].view(H, E)), rope64(qkv[H * E:(H + NKV) * E].view(NKV, E)),
            qkv[(H + NKV) * E:].view(NKV, E)]
    for got, w in zip([got_q[0], ck[:, pos], cv[:, pos]], want):
        err = (got.double() - w).abs().max().item()
        assert err <= 2 ** -7 * w.abs().max().item() + 1e-3, err
    assert ck[:, :pos].abs().max() == 0 and cv[:, pos + 1:].abs().max() == 0  # no other slot written


@gpu
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_gguf_gemv_at_a_llama_shape_gpu(fmt):
    rec = gguf_record(fmt, 3072, 2048, seed=6)
    t = from_quantized_linear(rec, "cuda")
    x = torch.randn(1, 2048, device="cuda").to(torch.bfloat16)
    got = t.gemv(x).double().cpu().numpy()[0]
    want = oracle_product(rec, x.float().cpu().numpy()[0])
    assert np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max() + 1e-3


@gpu
@pytest.mark.parametrize("spec", ["int8", "int4:64"])
@pytest.mark.parametrize("N, K", [(16384, 2048), (3072, 8192)])
def test_dequantize_at_llama_shapes_equals_the_oracle_gpu(spec, N, K):
    from refimpl.quant.schemes import dequantize_int4, dequantize_int8
    w = torch.randn(N, K, device="cuda") * 0.02
    t = quantize(w, QuantSpec.parse(spec))
    q, s = t.q.cpu().numpy(), t.scale.float().cpu().numpy()
    want = dequantize_int8(q, s) if spec == "int8" else dequantize_int4(q, s, t.low.float().cpu().numpy(), 64)
    np.testing.assert_array_equal(bits(t.dequantize().cpu().numpy()), bits(want))
    np.testing.assert_array_equal(t.dequantize(torch.bfloat16).float().cpu().numpy(),
                                  torch.from_numpy(want).to(torch.bfloat16).float().numpy())


@gpu
@pytest.mark.parametrize("spec", ["int8", "int4:64"])
def test_quantized_bf16_engine_on_gpu_tracks_the_refimpl(tmp_path, spec):
    cfg = tiny_config(tied=True)
    dense = Checkpoint(tmp_path, cfg, random_params(cfg, seed=11, std=0.15))
    ckpt = Checkpoint(tmp_path, cfg, quantize_params(dense.params, cfg, QuantSpec.parse(spec)))
    acc = AccelEngine.from_checkpoint(dense, device="cuda", dtype="bf16", quant=QuantSpec.parse(spec))
    ref = RefEngine(ckpt)
    prompt = [3, 17, 42, 5]
    want = ref.logits(prompt, np.arange(4), ref.new_cache(8))
    sess = acc.session(16)
    got = acc.to_numpy(acc.prefill(prompt, sess))[0]
    assert compare("logits", got, want, TOLERANCES["bf16"]).ok
    s = Sampling(max_new_tokens=6)
    want_ids, got_ids = list(ref.generate(prompt, s)), list(acc.generate(prompt, s))  # accel: graph replays, bf16
    assert len(got_ids) == len(want_ids) == 6
    n = next((i for i, (g, w) in enumerate(zip(got_ids, want_ids)) if g != w), 6)
    if n < 6:  # the first token that differs must be a near-tie of the oracle's (after it the contexts differ)
        ctx = prompt + want_ids[:n]
        want = ref.logits(ctx, np.arange(len(ctx)), ref.new_cache(len(ctx)))
        got = acc.to_numpy(acc.prefill(ctx, acc.session(16)))[0]
        assert near_tie(want, got_ids[n], NOISE * rms(got, want)), (n, got_ids, want_ids)
