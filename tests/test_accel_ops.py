"""accel.ops against refimpl.model.ops on CPU, fp32, tiny odd shapes.

Each test runs twice: "triton" runs the Triton kernels under the interpreter (TRITON_INTERPRET=1, which
tests/conftest.py sets without CUDA), "torch" runs accel's plain-torch CPU fallback. Real shapes, bf16 and the
compiled kernels are in tests/test_accel_ops_gpu.py.

Tolerance, fp32: atol = rtol = 1e-5. Both sides compute the same fp32 formulas; they differ only in summation
order (reductions over D <= 72, softmax over <= 80 keys, online vs two-pass softmax) and rsqrt vs 1/sqrt, i.e. a
few ulps of values of magnitude <= ~10 (measured: <= 5e-7). The interpreter's fp32 tl.dot is exact IEEE.
"""
import os
import zlib

import numpy as np
import pytest
import torch

from refimpl.model import ops as R
from refimpl.model.config import RopeScaling

from accel import ops as A  # noqa: E402
from accel.kernels.tuning import Tuning  # noqa: E402

ATOL = RTOL = 1e-5
GQA = [(4, 4), (4, 2), (8, 2), (4, 1)]  # (H, K): ratios 1, 2, 4 and MQA


@pytest.fixture(params=["triton", "torch"])
def path(request):
    if request.param == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors reach the kernels only under TRITON_INTERPRET=1 (CUDA: test_accel_ops_gpu.py)")
    with A.torch_only(request.param == "torch"):
        yield request.param


def rng_for(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))  # reproducible (hash() is salted per process)


def randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def close(got, want, what, atol=ATOL, rtol=RTOL):
    """assert_close reports the count of mismatches and where the largest one is."""
    torch.testing.assert_close(got, t(want), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("D", [48, 72])
def test_embedding(path, T, D):
    rng = rng_for("emb", T, D)
    table, ids = randn(rng, 37, D), rng.integers(0, 37, T)
    close(A.embedding(t(ids), t(table)), R.embedding(ids, table), "embedding", atol=0, rtol=0)


@pytest.mark.parametrize("T", [1, 17])
@pytest.mark.parametrize("D", [48, 72])
def test_embedding_rms_norm(path, T, D):
    """The prefill's first launch: the gathered rows exactly, and their RMSNorm as refimpl's."""
    rng = rng_for("emb-norm", T, D)
    table, ids, w = randn(rng, 37, D) * 3, rng.integers(0, 37, T), 1 + randn(rng, D) / 10
    x, h = A.embedding_rms_norm(t(ids), t(table), t(w), 1e-5)
    want = R.embedding(ids, table)
    close(x, want, "embedding_rms_norm x", atol=0, rtol=0)
    close(h, R.rms_norm(want, w, 1e-5), "embedding_rms_norm h")


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("D", [48, 72])
def test_rms_norm_and_fused_residual(path, T, D):
    rng = rng_for("norm", T, D)
    x, r, w = randn(rng, T, D) * 3, randn(rng, T, D), randn(rng, D)
    close(A.rms_norm(t(x), t(w), 1e-5), R.rms_norm(x, w, 1e-5), "rms_norm")
    s, h = A.add_rms_norm(t(x), t(r), t(w), 1e-6)
    close(s, x + r, "add_rms_norm sum", atol=0, rtol=0)
    close(h, R.rms_norm(x + r, w, 1e-6), "add_rms_norm norm")


@pytest.mark.parametrize("E", [16, 32, 64])
@pytest.mark.parametrize("scaling", [None, RopeScaling()])
def test_rope_tables_far_positions(E, scaling):
    positions = np.array([0, 1, 2, 17, 8191, 8192, 50_000, 131_071])  # past original_max_position_embeddings
    cos, sin = A.rope_tables(t(positions), E, 500000.0, scaling)
    want_cos, want_sin = R.rope_tables(positions, E, 500000.0, scaling)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (len(positions), E // 2)
    # identical fp32 angles (same inv_freq, same product); torch's and NumPy's cos/sin differ by <= 1 ulp
    close(cos, want_cos, "cos", atol=1e-6, rtol=0)
    close(sin, want_sin, "sin", atol=1e-6, rtol=0)


def _rope_inputs(rng, T, H, K, E):
    positions = rng.integers(0, 5000, T)
    cos, sin = R.rope_tables(positions, E, 500000.0, RopeScaling())
    return randn(rng, T, H, E), randn(rng, T, K, E), randn(rng, T, K, E), cos, sin, positions


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("H,K,E", [(4, 2, 16), (3, 1, 32), (8, 8, 64)])
def test_rope(path, T, H, K, E):
    q, k, _, cos, sin, _ = _rope_inputs(rng_for("rope", T, H, K, E), T, H, K, E)
    got_q, got_k = A.rope(t(q), t(k), t(cos), t(sin))
    want_q, want_k = R.rope(q, k, cos, sin)
    close(got_q, want_q, "rope q")
    close(got_k, want_k, "rope k")


@pytest.mark.parametrize("T", [1, 17])
@pytest.mark.parametrize("H,K,E", [(4, 2, 16), (4, 1, 32)])
def test_rope_kv_write_equals_rope_then_cache_write(path, T, H, K, E):
    rng = rng_for("ropekv", T, H, K, E)
    S = 40
    positions = rng.permutation(S)[:T]  # any slots, not only a contiguous run
    cos, sin = R.rope_tables(positions, E, 500000.0, None)
    # q, k, v as views of one fused projection output [T, (H + 2K)·E], as the engine produces them
    qkv = randn(rng, T, (H + 2 * K) * E)
    q, k, v = (qkv[:, :H * E].reshape(T, H, E), qkv[:, H * E:(H + K) * E].reshape(T, K, E),
               qkv[:, (H + K) * E:].reshape(T, K, E))
    tq = t(qkv)
    tq_, tk_, tv_ = (tq[:, :H * E].view(T, H, E), tq[:, H * E:(H + K) * E].view(T, K, E),
                     tq[:, (H + K) * E:].view(T, K, E))
    cache_k, cache_v = randn(rng, K, S, E), randn(rng, K, S, E)
    got_ck, got_cv = t(cache_k.copy()), t(cache_v.copy())
    got_q = A.rope_kv_write(tq_, tk_, tv_, t(cos), t(sin), got_ck, got_cv, t(positions))
    want_q, want_k = R.rope(q, k, cos, sin)
    cache_k[:, positions] = want_k.transpose(1, 0, 2)  # [T, K, E] -> [K, T, E]
    cache_v[:, positions] = v.transpose(1, 0, 2)
    close(got_q, want_q, "rope_kv_write q")
    close(got_ck, cache_k, "rope_kv_write cache_k")
    close(got_cv, cache_v, "rope_kv_write cache_v", atol=0, rtol=0)


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("F", [48, 72])
def test_swiglu_and_fused_gate_up(path, T, F):
    rng = rng_for("swiglu", T, F)
    gate, up = randn(rng, T, F) * 4, randn(rng, T, F)
    want = R.swiglu(gate, up)
    close(A.swiglu(t(gate), t(up)), want, "swiglu")
    close(A.swiglu_gate_up(t(np.concatenate([gate, up], axis=1))), want, "swiglu_gate_up")


def _caches(rng, K, S, E):
    """Caches poisoned with NaN: a slot an op reads before writing it (or past the context) shows up as NaN."""
    return np.full((K, S, E), np.nan, np.float32), np.full((K, S, E), np.nan, np.float32)


@pytest.mark.parametrize("H,K", GQA)
@pytest.mark.parametrize("E", [16, 64])
@pytest.mark.parametrize("T", [3, 17])
def test_attention_prefill_then_second_chunk(path, H, K, E, T):
    """Chunk 1 at positions 0..T-1 into an empty cache; chunk 2 (T2 tokens) at T..T+T2-1 over the partly filled
    cache; the rest of the cache stays NaN and must never be read."""
    rng = rng_for("prefill", H, K, E, T)
    S, T2 = 80, 19
    ref_k, ref_v = _caches(rng, K, S, E)
    got_k, got_v = t(ref_k.copy()), t(ref_v.copy())
    for first, n in ((0, T), (T, T2)):
        q, k, v = randn(rng, n, H, E), randn(rng, n, K, E), randn(rng, n, K, E)
        positions = np.arange(first, first + n)
        want = R.attention(q, k, v, ref_k, ref_v, positions)
        got = A.attention(t(q), t(k), t(v), got_k, got_v, t(positions))
        close(got, want, f"attention chunk at {first}")
    # the caches hold exactly the written slots, and NaN everywhere else
    torch.testing.assert_close(got_k, t(ref_k), atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(got_v, t(ref_v), atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("H,K", GQA)
@pytest.mark.parametrize("E", [16, 32])
@pytest.mark.parametrize("p", [0, 5, 37, 79])
def test_attention_decode_over_filled_cache(path, H, K, E, p):
    """One token at position p over slots 0..p-1 already filled; S = 80 with 16-slot splits gives 5 splits, of
    which only the first ceil((p+1)/16) hold context (the rest take the empty-split path). The kernels' counters
    are zero again after each launch (the next launch, or graph replay, starts from them)."""
    rng = rng_for("decode", H, K, E, p)
    S = 80
    ref_k, ref_v = _caches(rng, K, S, E)
    ref_k[:, :p], ref_v[:, :p] = randn(rng, K, p, E), randn(rng, K, p, E)
    got_k, got_v = t(ref_k.copy()), t(ref_v.copy())
    q, k, v = randn(rng, 1, H, E), randn(rng, 1, K, E), randn(rng, 1, K, E)
    want = R.attention(q, k, v, ref_k, ref_v, np.array([p]))
    close(A.attention(t(q), t(k), t(v), got_k, got_v, t(np.array([p]))), want, "attention decode (default splits)")
    for split_len in (16, 32):
        tuning = Tuning(decode_attention={"split_len": split_len})
        got = A.decode_attention(t(q), got_k, got_v, t(np.array([p])), tuning)
        close(got, want, f"decode_attention split_len={split_len}")
    if path == "triton":  # the fused combine's last program of each kv head returned its counter to 0
        from accel.kernels.common import arrival_counters
        assert not arrival_counters(torch.device("cpu"), K).any(), "arrival counters not back to 0"


@pytest.mark.parametrize("H,K", GQA)
@pytest.mark.parametrize("masked", [False, True])
def test_cross_attention_with_an_all_masked_row(path, H, K, masked):
    rng = rng_for("xattn", H, K, masked)
    T, N, E = 5, 13, 16
    q, k, v = randn(rng, T, H, E), randn(rng, K, N, E), randn(rng, K, N, E)
    mask = None
    if masked:
        mask = rng.random((T, N)) < 0.5
        mask[0] = False  # a text token before any image: its output must be zeros
        mask[1] = True
    got = A.cross_attention(t(q), t(k), t(v), None if mask is None else t(mask))
    close(got, R.cross_attention(q, k, v, mask), "cross_attention")
    if masked:
        assert torch.count_nonzero(got[0]) == 0


@pytest.mark.parametrize("R_", [1, 4])
def test_lora_merge(R_):
    rng = rng_for("lora", R_)
    w, a, b = randn(rng, 24, 40), randn(rng, R_, 40), randn(rng, 24, R_)
    want = R.lora_merge(w, a, b, 2.0)
    close(A.lora_merge(t(w), t(a), t(b), 2.0), want, "lora_merge fp32")
    # bf16 weight: merged in fp32, rounded once; the only difference from refimpl's fp32 result is that rounding
    got = A.lora_merge(t(w).bfloat16(), t(a).bfloat16(), t(b).bfloat16(), 2.0)
    assert got.dtype == torch.bfloat16
    want_bf = R.lora_merge(t(w).bfloat16().float().numpy(), t(a).bfloat16().float().numpy(),
                           t(b).bfloat16().float().numpy(), 2.0)
    torch.testing.assert_close(got, t(want_bf).bfloat16(), atol=0, rtol=0)


# ---- the decode GEMV (accel/kernels/gemv.py) with each fusion, against a torch composition of the unfused ops ----

GEMV_SHAPES = [(37, 53), (67, 200)]  # (N, K): neither a multiple of any block
# default; persistent (3 programs over 10 or 17 row blocks) with K and N tails; one program a block, one K chunk;
# split-K over 2 or 4 (K 53: 2 with a tail) and 7 slices with the last-ticket reduce; split with one slice;
# streaming (K 200 only: it needs K a multiple of block_k; 25 chunks of 8) over 3 programs (N tail), 2 or 4 stages
GEMV_CONFIGS = [None, ("persist", 4, 32, 4, 3), ("persist", 16, 64, 4, None), ("split", 16, 32, 4),
                ("split", 8, 32, 4, None), ("split", 64, 256, 4), ("stream", 8, 8, 4, 3, 2),
                ("stream", 16, 8, 4, None, 4)]


@pytest.mark.parametrize("N,K,config", [(N, K, c) for N, K in GEMV_SHAPES for c in GEMV_CONFIGS
                                        if not (c and c[0] == "stream" and K % c[2])])
def test_gemv_fusions_match_the_unfused_ops(N, K, config):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors reach the kernel only under TRITON_INTERPRET=1 (CUDA: test_accel_ops_gpu.py)")
    import torch.nn.functional as F

    from accel.kernels.gemv import gemv_fwd
    from accel.ops.torch_ops import torch_rms_norm, torch_swiglu_gate_up
    rng = rng_for("gemv", N, K, config)
    w, x, nw = t(randn(rng, N, K)), t(randn(rng, 1, K) * 3), t(randn(rng, K))
    gate_up, r = t(randn(rng, 1, 2 * K) * 3), t(randn(rng, 1, N))
    # fp32 throughout; the two sides differ only in summation order over K <= 200 (values ~ 10-50)
    tol = dict(atol=1e-4, rtol=1e-5)
    close(gemv_fwd(w, x, config=config), F.linear(x, w).numpy(), "gemv", **tol)
    close(gemv_fwd(w, x, norm_weight=nw, eps=1e-5, config=config),
          F.linear(torch_rms_norm(x, nw, 1e-5), w).numpy(), "gemv rms_norm prologue", **tol)
    close(gemv_fwd(w, gate_up, swiglu=True, config=config),
          F.linear(torch_swiglu_gate_up(gate_up), w).numpy(), "gemv swiglu prologue", **tol)
    resid = r.clone()
    got = gemv_fwd(w, gate_up, swiglu=True, residual=resid, out=resid, config=config)  # in place, as decode does
    assert got is resid
    close(resid, (r + F.linear(torch_swiglu_gate_up(gate_up), w)).numpy(), "gemv swiglu + residual", **tol)
    resid, g = r.clone(), torch.tensor([-0.37])  # a cross layer's tanh gate (the split-K reduce's epilogue too)
    gemv_fwd(w, x, residual=resid, gate=g, out=resid, config=config)
    close(resid, (r + g * F.linear(x, w)).numpy(), "gemv gated residual", **tol)
    close(gemv_fwd(w, gate_up, swiglu=True, gate=g, config=config),
          (g * F.linear(torch_swiglu_gate_up(gate_up), w)).numpy(), "gemv gated, no residual", **tol)


QKV_ROPE_SHAPES = [(4, 2, 16, 40), (3, 1, 24, 53), (8, 8, 32, 64), (8, 2, 64, 37)]  # (H, K, E, D)
# the torch version; the fused kernel: one program a head (CPU default), or 4-column slices of each half (E/2 >= 4
# here), or streaming in 8-wide K chunks over 3 programs (D a multiple of 8 only)
QKV_ROPE_PATHS = [(False, None), (True, None), (True, (4, 4)), (True, (4, 4, 2, 8, 3))]  # (fused, config)


@pytest.mark.parametrize("H,K,E,D,fused,config", [(*shape, fused, c) for shape in QKV_ROPE_SHAPES
                                                  for fused, c in QKV_ROPE_PATHS
                                                  if not (c and len(c) > 2 and shape[3] % c[3])])
def test_decode_qkv_rope_matches_refimpl(H, K, E, D, fused, config):
    """The decode step's norm -> qkv -> RoPE -> cache write (accel/kernels/qkv_rope.py, or its torch version) for one
    token at a position in the middle of the cache, against refimpl's rms_norm, linear and rope; every other cache
    slot stays as it was. GQA 2/3/1/4, head dims whose half is not a power of 2, D not a power of 2."""
    if fused and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors reach the kernel only under TRITON_INTERPRET=1 (CUDA: test_accel_ops_gpu.py)")
    assert config is None or config[0] <= E // 2  # a slice within each half
    from accel.kernels.qkv_rope import qkv_rope_fwd
    rng = rng_for("qkv_rope", H, K, E, D)
    S, pos = 11, 6
    w, x, nw = randn(rng, (H + 2 * K) * E, D), randn(rng, 1, D) * 3, randn(rng, D)
    cos, sin = R.rope_tables(np.arange(S), E, 500000.0, RopeScaling())  # [S, E/2]
    cache_k, cache_v = randn(rng, K, S, E), randn(rng, K, S, E)
    got_ck, got_cv = t(cache_k.copy()), t(cache_v.copy())
    position = torch.tensor([pos])
    if fused:
        got_q = qkv_rope_fwd(t(w), t(x), t(nw), 1e-5, t(cos), t(sin), position, got_ck, got_cv,
                             config=config)
    else:
        with A.torch_only():
            got_q = A.qkv_rope(t(x), t(nw), t(w), 1e-5, t(cos), t(sin), position, got_ck, got_cv)
    qkv = R.linear(R.rms_norm(x, nw, 1e-5), w)  # [1, (H+2K)·E]
    q, k, v = qkv[:, :H * E].reshape(1, H, E), qkv[:, H * E:(H + K) * E].reshape(1, K, E), qkv[:, (H + K) * E:]
    want_q, want_k = R.rope(q, k, cos[pos:pos + 1], sin[pos:pos + 1])
    cache_k[:, pos], cache_v[:, pos] = want_k[0], v.reshape(K, E)
    tol = dict(atol=1e-4, rtol=1e-5)  # fp32, sums over D <= 64 of values ~ 10
    close(got_q, want_q, "qkv_rope q", **tol)
    close(got_ck, cache_k, "qkv_rope cache_k", **tol)
    close(got_cv, cache_v, "qkv_rope cache_v", **tol)


def test_gemv_config_fills_the_gpu_at_llama_shapes():
    """At the Llama 3.2 shapes on 132 SMs (the measured table, or the rule): at least one program an SM, never
    more programs than row blocks, no K tail (unmasked 16-byte loads) unless one slice covers the row; the
    persistent kernel with every warp
    along K (BLOCK_K = 8 bf16 × 32 lanes × warps), the layout in which f(x) needs no shared-memory conversion
    in its loop."""
    from accel.kernels.gemv import gemv_config
    for N, K in [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192),
                 (5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192), (4096, 4096), (28672, 4096), (4096, 14336)]:
        cfg = gemv_config(N, K, 132)
        blocks = -(-N // cfg.block_n)
        progs = blocks * -(-K // cfg.block_k) if cfg.kind == "split" else cfg.programs or blocks
        assert 132 <= progs and (K % cfg.block_k == 0 or cfg.block_k >= K), (N, K, cfg)  # or one masked slice
        if cfg.kind == "persist":
            assert progs <= blocks and cfg.block_k == 256 * cfg.warps, (N, K, cfg)
        if cfg.kind == "stream":  # persistent, whole K chunks (its loads are never masked)
            assert progs <= blocks and K % cfg.block_k == 0, (N, K, cfg)


@pytest.mark.parametrize("N,K", [(37, 53), (64, 40)])
def test_decode_gemv_ops_match_refimpl(path, N, K):
    """The fused decode ops norm_linear, linear_add, swiglu_linear_add, norm_mlp_add through the op layer (GEMV
    kernel or torch version) against refimpl's rms_norm / swiglu / linear and the residual add."""
    rng = rng_for("gemv-ops", N, K)
    w, x, nw, r = randn(rng, N, K), randn(rng, 1, K) * 3, randn(rng, K), randn(rng, 1, N)
    w_down, gate_up = randn(rng, N, K), randn(rng, 1, 2 * K) * 3
    tol = dict(atol=1e-4, rtol=1e-5)  # fp32, sums over K <= 53 of values ~ 10
    close(A.norm_linear(t(x), t(nw), t(w), 1e-5), R.linear(R.rms_norm(x, nw, 1e-5), w), "norm_linear", **tol)
    resid = t(r.copy())
    assert A.linear_add(t(x), t(w), resid) is resid
    close(resid, r + R.linear(x, w), "linear_add", **tol)
    resid = t(r.copy())
    A.swiglu_linear_add(t(gate_up), t(w_down), resid)
    close(resid, r + R.linear(R.swiglu(gate_up[:, :K], gate_up[:, K:]), w_down), "swiglu_linear_add", **tol)
    g = np.tanh(np.array([0.7], np.float32))  # the gated residuals of Mllama's cross layers: x + tanh(g)·branch
    resid = t(r.copy())
    A.linear_add(t(x), t(w), resid, gate=t(g))
    close(resid, r + g * R.linear(x, w), "linear_add gated", **tol)
    resid = t(r.copy())
    A.swiglu_linear_add(t(gate_up), t(w_down), resid, gate=t(-g))
    close(resid, r - g * R.linear(R.swiglu(gate_up[:, :K], gate_up[:, K:]), w_down), "swiglu_linear_add gated",
          **tol)
    w_gate_up, w_mlp_down = randn(rng, 2 * N, K), randn(rng, K, N)  # the whole MLP block: [2F, D], [D, F]
    resid = t(x.copy())
    assert A.norm_mlp_add(resid, t(nw), t(w_gate_up), t(w_mlp_down), 1e-5) is resid
    gu = R.linear(R.rms_norm(x, nw, 1e-5), w_gate_up)  # [1, D] -> [1, 2F]
    close(resid, x + R.linear(R.swiglu(gu[:, :N], gu[:, N:]), w_mlp_down), "norm_mlp_add", **tol)
    # accumulate=False (a tensor-parallel rank's partial sums): the product overwrites the residual
    resid = t(r.copy())
    assert A.linear_add(t(x), t(w), resid, accumulate=False) is resid
    close(resid, R.linear(x, w), "linear_add written", **tol)
    resid = t(r.copy())
    A.swiglu_linear_add(t(gate_up), t(w_down), resid, accumulate=False)
    close(resid, R.linear(R.swiglu(gate_up[:, :K], gate_up[:, K:]), w_down), "swiglu_linear_add written", **tol)
    resid = t(x.copy())
    A.norm_mlp_add(resid, t(nw), t(w_gate_up), t(w_mlp_down), 1e-5, accumulate=False)
    close(resid, R.linear(R.swiglu(gu[:, :N], gu[:, N:]), w_mlp_down), "norm_mlp_add written", **tol)
    # a gate with accumulate=False (a tensor-parallel rank's cross layer): gate · product overwrites it
    resid = t(r.copy())
    A.linear_add(t(x), t(w), resid, gate=t(g), accumulate=False)
    close(resid, g * R.linear(x, w), "linear_add gated, written", **tol)
    resid = t(r.copy())
    A.swiglu_linear_add(t(gate_up), t(w_down), resid, gate=t(-g), accumulate=False)
    close(resid, -g * R.linear(R.swiglu(gate_up[:, :K], gate_up[:, K:]), w_down), "swiglu_linear_add gated, written",
          **tol)


@pytest.mark.parametrize("V", [7, 1000, 1537])
def test_argmax_row_and_greedy_next(path, V):
    """The first index of the maximum (ties included), and greedy_next's bookkeeping on the device tensors."""
    rng = rng_for("argmax", V)
    logits = randn(rng, 1, V)
    logits[0, V // 3] = logits[0, V - 1] = logits.max() + 1  # a tie: the first one wins
    assert int(A.argmax_row(t(logits))) == V // 3
    token, position = torch.zeros(1, dtype=torch.int64), torch.tensor([4])
    history, step = torch.full((3,), -1, dtype=torch.int64), torch.tensor([1])
    A.greedy_next(t(logits), token, position, history, step)
    assert (int(token), int(position), history.tolist(), int(step)) == (V // 3, 5, [-1, V // 3, -1], 2)
