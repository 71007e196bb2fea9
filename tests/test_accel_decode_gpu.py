"""The decode step at the real Llama 3.2 widths on CUDA (skipped without it): the fused qkv + RoPE + cache-write
kernel against a float64 oracle, and a 1B-wide engine (2 layers, random bf16 weights) under every decode variant.

Oracle for the fused kernel: rms_norm by the unfused torch ops in the kernel's dtype (the same roundings), the
product in float64 rounded to the dtype (the GEMV's output dtype), RoPE in float64 from the fp32 tables.
Tolerances: tests/test_accel_ops_gpu.py's (bf16: atol/rtol 2e-2, rel 1e-2; fp32: 1e-4 / 1e-5 for sums over D).
The engine checks need no tolerance where the kernels are the same: a CUDA graph replays the eager kernels, so
those logits must be bit-identical; the torch-ops engine (another summation order) is compared with
refimpl.compare's bf16 tolerance.
"""
import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4, rel=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2, rel=1e-2)}


def check(what, got, want, tol):
    got64 = got.double()
    rel = ((got64 - want).norm() / want.norm()).item()
    print(f"ERR {what} {str(got.dtype)[6:]} {tuple(got.shape)} max_abs={(got64 - want).abs().max().item():.3e} "
          f"rel={rel:.3e}")
    torch.testing.assert_close(got64, want, atol=tol["atol"], rtol=tol["rtol"], msg=lambda m: f"{what}: {m}")
    assert rel <= tol["rel"], f"{what}: relative error {rel:.2e}"


def rope64(x, cos, sin):
    """x [..., E] float64, cos/sin [E/2] -> HF's rotate_half RoPE."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,K,E,D", [(32, 8, 64, 2048), (24, 8, 128, 3072)])  # 1B, 3B
# (half_n, warps[, stages, block_k, programs]): the last the streaming kernel
@pytest.mark.parametrize("config", [None, (2, 4), (4, 8), (8, 4, 3, 512, 396)])
def test_qkv_rope_at_llama_shapes(dtype, H, K, E, D, config):
    from accel.kernels.qkv_rope import qkv_rope_fwd
    from accel.ops.torch_ops import torch_rms_norm
    g = torch.Generator(device="cuda").manual_seed(D + E)
    N, S, pos = (H + 2 * K) * E, 4096, 3001
    w = (torch.randn(N, D, device="cuda", generator=g) * D ** -0.5).to(dtype)
    x = (3 * torch.randn(1, D, device="cuda", generator=g)).to(dtype)
    nw = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(dtype)
    ang = torch.rand(S, E // 2, device="cuda", generator=g) * 6.3
    cos, sin = ang.cos(), ang.sin()
    ck = torch.full((K, S, E), float("nan"), device="cuda", dtype=dtype)  # only slot `pos` may be written
    cv = ck.clone()
    outs = []
    for _ in range(2):
        q = qkv_rope_fwd(w, x, nw, 1e-5, cos, sin, torch.tensor([pos], device="cuda"), ck, cv, config=config)
        outs.append((q.clone(), ck[:, pos].clone(), cv[:, pos].clone()))
    assert all(torch.equal(a, b) for a, b in zip(*outs)), "repeated launches differ"
    qkv = (torch_rms_norm(x, nw, 1e-5).double() @ w.double().T).to(dtype).double()[0]  # [N]
    c, s = cos[pos].double(), sin[pos].double()
    check("qkv_rope q", q[0], rope64(qkv[:H * E].view(H, E), c, s), TOL[dtype])
    check("qkv_rope k", ck[:, pos], rope64(qkv[H * E:(H + K) * E].view(K, E), c, s), TOL[dtype])
    check("qkv_rope v", cv[:, pos], qkv[(H + K) * E:].view(K, E), TOL[dtype])
    assert torch.isnan(ck[:, :pos]).all() and torch.isnan(ck[:, pos + 1:]).all() and torch.isnan(cv[:, :pos]).all()


@pytest.fixture(scope="module")
def wide():
    """The 1B's widths (D 2048, F 8192, H 32, K 8, E 64, V 128256) with 2 layers: the real GEMV and attention
    shapes, so the table's split-K and streaming configs and the fused qkv kernel run as in the 1B's decode step."""
    from accel.weights import random_weights
    from refimpl.model.config import PRESETS
    cfg = dataclasses.replace(PRESETS["llama-3.2-1b"], num_hidden_layers=2)
    return cfg, random_weights(cfg, "cuda", torch.bfloat16, seed=3, std=0.066)


def decode_logits(cfg, w, use_triton=True, use_graph=True, tokens=(5, 90_000, 11, 128_000, 31, 7)):
    """The prompt's logits and those of 6 decode steps on fixed tokens (not argmax: variants that round
    differently must still see the same inputs) -> [7, V] fp32."""
    from accel.engine import AccelEngine
    eng = AccelEngine(cfg, w, torch.device("cuda"), "bf16", use_graph=use_graph, use_triton=use_triton)
    sess = eng.session(200)
    prompt = list(range(100, 164))
    out = [eng.prefill(prompt, sess).float().clone()]
    for p, t in enumerate(tokens, start=len(prompt)):
        out.append(sess.decoder.step(torch.tensor([t], device="cuda"), p).float().clone())
    return torch.cat(out)  # [7, V]


def test_decode_variants_at_1b_width(wide):
    from refimpl.compare import TOLERANCES, compare
    cfg, w = wide
    base = decode_logits(cfg, w)
    assert torch.equal(decode_logits(cfg, w, use_graph=False), base), "graph replay differs from eager"
    assert torch.equal(decode_logits(cfg, w), base), "a second engine's graph differs (scratch/counters not re-armed?)"
    torch_ops = decode_logits(cfg, w, use_triton=False)
    for i, (a, b) in enumerate(zip(base, torch_ops)):
        r = compare(f"step {i}", a.cpu().numpy(), b.cpu().numpy(), TOLERANCES["bf16"])
        assert r.ok, f"triton vs torch ops: {r}"


def test_greedy_graph_at_1b_width(wide):
    """decode_greedy's greedy graph (argmax, history and position on the device) picks the tokens a host loop
    over the plain graph picks (the same kernels: identical logits)."""
    from accel import ops
    from accel.engine import AccelEngine
    cfg, w = wide
    eng = AccelEngine(cfg, w, torch.device("cuda"), "bf16")
    sess = eng.session(120)
    prompt = list(range(100, 164))
    got = eng.decode_greedy(sess, eng.prefill(prompt, sess), len(prompt), 40).tolist()
    logits, want = eng.prefill(prompt, sess), []
    for p in range(len(prompt), len(prompt) + 40):
        token = ops.argmax_row(logits)
        want.append(int(token))
        logits = sess.decoder.step(token, p)
    assert got == want
