"""accel.ops' compiled Triton kernels on CUDA at Llama 3.2 shapes, bf16 and fp32 (skipped without CUDA).

Oracle: refimpl.model.ops in fp32 (NumPy) on the same inputs, or, for the large attention shapes, a float64 torch
computation on the GPU (the NumPy oracle would take minutes at T = 4096). bf16 tests draw fp32 inputs, round them
to bf16, and give the oracle the rounded values upcast: both sides compute the same function on the same inputs.
Every check prints `ERR op dtype shape max_abs rel` (run with -s to see the table).

Tolerances (atol, rtol, and a bound on ‖got − want‖ / ‖want‖):
  * fp32 elementwise ops: 1e-5 — fp32 math like refimpl's, plus the GPU's approximate rsqrt/exp2 (~2^-22 relative);
  * fp32 attention: 1e-4 and rel 1e-5 — IEEE fp32 dots (input_precision="ieee"), sums over up to 4096 keys;
  * bf16: 2e-2 and rel 1e-2 — each output is rounded to bf16 (2^-8 relative), RMSNorm and SwiGLU round twice
    (HF's order), and attention rounds the probabilities to bf16 before the P·V product (as flash kernels do).
Embedding and cache writes are copies: exact.
"""
import math

import numpy as np
import pytest
import torch

from refimpl.model import ops as R
from refimpl.model.config import RopeScaling

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
from accel import ops as A  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5, rel=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2, rel=1e-2)}
ATTN_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4, rel=1e-5), torch.bfloat16: TOL[torch.bfloat16]}
DTYPES = [torch.float32, torch.bfloat16]
SEQ = [1, 17, 1000, 4096]
HEADS = [(32, 8, 64), (24, 8, 128)]  # Llama 3.2 1B and 3B: (H, K, E)


def draw(seed, *shape, dtype, scale=1.0):
    """(tensor on the GPU in dtype, its exact values as fp32 NumPy)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(shape, generator=g, device="cuda") * scale).to(dtype)
    return x, x.float().cpu().numpy()


def check(what, got, want, tol):
    want = torch.as_tensor(want).to(got.device, torch.float64)
    got64 = got.to(torch.float64)
    err = (got64 - want).abs().max().item()
    rel = ((got64 - want).norm() / want.norm().clamp_min(1e-30)).item()
    print(f"ERR {what} {str(got.dtype)[6:]} {tuple(got.shape)} max_abs={err:.3e} rel={rel:.3e}")
    assert torch.isfinite(got64).all(), f"{what}: non-finite output"
    torch.testing.assert_close(got64, want, atol=tol["atol"], rtol=tol["rtol"], msg=lambda m: f"{what}: {m}")
    assert rel <= tol["rel"], f"{what}: relative error {rel:.2e} > {tol['rel']}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", SEQ)
def test_embedding_and_norms(dtype, T):
    table, _ = draw(1, 128256, 2048, dtype=dtype)
    ids = torch.randint(0, 128256, (T,), device="cuda")
    torch.testing.assert_close(A.embedding(ids, table), table[ids], atol=0, rtol=0)
    w, wn = draw(4, 2048, dtype=dtype)
    x, h = A.embedding_rms_norm(ids, table, w, 1e-5)
    torch.testing.assert_close(x, table[ids], atol=0, rtol=0)
    check("embedding_rms_norm", h, R.rms_norm(x.float().cpu().numpy(), wn, 1e-5), TOL[dtype])
    for D in (2048, 3072):
        x, xn = draw(2, T, D, dtype=dtype, scale=3.0)
        r, rn = draw(3, T, D, dtype=dtype)
        w, wn = draw(4, D, dtype=dtype)
        check("rms_norm", A.rms_norm(x, w, 1e-5), R.rms_norm(xn, wn, 1e-5), TOL[dtype])
        s, h = A.add_rms_norm(x, r, w, 1e-5)
        torch.testing.assert_close(s, x + r, atol=0, rtol=0)  # the sum rounded to dtype, like torch's x + r
        check("add_rms_norm", h, R.rms_norm(s.float().cpu().numpy(), wn, 1e-5), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", SEQ)
@pytest.mark.parametrize("H,K,E", HEADS)
def test_rope_and_kv_write(dtype, T, H, K, E):
    positions_np = np.sort(np.random.default_rng(T).choice(131072, T, replace=False))
    positions = torch.from_numpy(positions_np).cuda()
    cos, sin = A.rope_tables(positions, E, 500000.0, RopeScaling())
    want_cos, want_sin = R.rope_tables(positions_np, E, 500000.0, RopeScaling())
    check("rope_tables.cos", cos, want_cos, dict(atol=1e-6, rtol=0, rel=1e-6))
    check("rope_tables.sin", sin, want_sin, dict(atol=1e-6, rtol=0, rel=1e-6))
    q, qn = draw(5, T, H, E, dtype=dtype)
    k, kn = draw(6, T, K, E, dtype=dtype)
    v, _ = draw(7, T, K, E, dtype=dtype)
    want_q, want_k = R.rope(qn, kn, want_cos, want_sin)
    got_q, got_k = A.rope(q, k, cos, sin)
    check("rope.q", got_q, want_q, TOL[dtype])
    check("rope.k", got_k, want_k, TOL[dtype])
    cache_k = torch.full((K, 131072, E), float("nan"), dtype=dtype, device="cuda")
    cache_v = cache_k.clone()
    got_q2 = A.rope_kv_write(q, k, v, cos, sin, cache_k, cache_v, positions)
    torch.testing.assert_close(got_q2, got_q, atol=0, rtol=0)  # same kernel code path for q
    torch.testing.assert_close(cache_k[:, positions].transpose(0, 1), got_k, atol=0, rtol=0)
    torch.testing.assert_close(cache_v[:, positions].transpose(0, 1), v, atol=0, rtol=0)
    assert int(torch.isnan(cache_k).any(-1).sum()) == K * (131072 - T)  # nothing else written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", SEQ)
def test_swiglu(dtype, T):
    for F in (8192,):
        gate, gn = draw(8, T, F, dtype=dtype, scale=4.0)
        up, un = draw(9, T, F, dtype=dtype)
        want = R.swiglu(gn, un)
        check("swiglu", A.swiglu(gate, up), want, TOL[dtype])
        check("swiglu_gate_up", A.swiglu_gate_up(torch.cat([gate, up], dim=1)), want, TOL[dtype])


def attention64(q, cache_k, cache_v, positions, rows=512):
    """float64 oracle: q [T, H, E], cache [K, S, E], positions [T] -> [T, H, E] (causal by absolute position).
    `rows` queries at a time: at T = 4096, 32 heads the whole fp64 score matrix would be 4.3 GB, three times over."""
    T, H, E = q.shape
    K = cache_k.shape[0]
    n = int(positions.max()) + 1
    k, v = cache_k[:, :n].double(), cache_v[:, :n].double()  # [K, n, E]
    out = []
    for s in range(0, T, rows):
        qb, pb = q[s:s + rows], positions[s:s + rows]  # [t, H, E], [t]
        qg = qb.double().reshape(len(qb), K, H // K, E).permute(1, 2, 0, 3)  # [t, H, E] -> [K, H/K, t, E]
        scores = qg @ k[:, None].transpose(-1, -2) / math.sqrt(E)  # [K, H/K, t, n]
        visible = torch.arange(n, device=q.device)[None, :] <= pb[:, None]  # [t, n]
        o = torch.softmax(scores.masked_fill_(~visible, float("-inf")), -1) @ v[:, None]  # [K, H/K, t, E]
        out.append(o.permute(2, 0, 1, 3).reshape(len(qb), H, E))
    return torch.cat(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,K,E", HEADS)
@pytest.mark.parametrize("T", [17, 1000, 4096])
def test_attention_prefill_and_second_chunk(dtype, H, K, E, T):
    S = 8192
    cache_k = torch.full((K, S, E), float("nan"), dtype=dtype, device="cuda")
    cache_v = cache_k.clone()
    for seed, first, n in ((10, 0, T), (20, T, 333)):  # a prefill, then a chunk over the partly filled cache
        q, _ = draw(seed, n, H, E, dtype=dtype)
        k, _ = draw(seed + 1, n, K, E, dtype=dtype)
        v, _ = draw(seed + 2, n, K, E, dtype=dtype)
        positions = torch.arange(first, first + n, device="cuda")
        got = A.attention(q, k, v, cache_k, cache_v, positions)
        check(f"attention.prefill@{first}", got, attention64(q, cache_k, cache_v, positions), ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,K,E", HEADS)
@pytest.mark.parametrize("S,p", [(4096, 0), (4096, 16), (4096, 999), (4096, 4095), (32768, 20000)])
def test_attention_decode(dtype, H, K, E, S, p):
    cache_k, _ = draw(30, K, S, E, dtype=dtype)
    cache_v, _ = draw(31, K, S, E, dtype=dtype)
    cache_k[:, p + 1:], cache_v[:, p + 1:] = float("nan"), float("nan")  # past the context: never read
    q, _ = draw(32, 1, H, E, dtype=dtype)
    k, _ = draw(33, 1, K, E, dtype=dtype)
    v, _ = draw(34, 1, K, E, dtype=dtype)
    position = torch.tensor([p], device="cuda")
    got = A.attention(q, k, v, cache_k, cache_v, position)  # writes slot p, then split-K over the cache
    check(f"attention.decode@{p}/{S}", got, attention64(q, cache_k, cache_v, position), ATTN_TOL[dtype])


DECODE_LAUNCHES = [(None, dict(USE_DESC=True)), (1024, dict(USE_DESC=True, BLOCK_N=128, num_stages=3)),
                   (2048, dict(BLOCK_N=256, num_stages=2)), (512, dict(FUSED=False)),
                   (1024, dict(USE_DESC=True, BLOCK_N=128, num_stages=3, LATE_Q=True)),
                   (1024, dict(USE_DESC=True, BLOCK_N=64, num_stages=4, LATE_Q=True))]  # (split_len, config)


@pytest.mark.parametrize("H,K,E,split_len,config", [(*heads, n, c) for heads in HEADS for n, c in DECODE_LAUNCHES
                                                    if not (heads[2] > 64 and c.get("BLOCK_N") == 256)])
# 256 × 128 K/V blocks (E 128 with BLOCK_N 256) would exceed the shared memory: not a launch the sweep makes
@pytest.mark.parametrize("S,p", [(8192, 8191), (32768, 20000), (32768, 32767), (4096, 999)])
def test_decode_attention_launch_variants(H, K, E, S, p, split_len, config):
    """The decode kernel's sweep options (TMA descriptors, wider blocks, split lengths) over a cache whose slots
    past the context hold NaN."""
    from accel.kernels.decode_attn import decode_attention_fwd
    dtype = torch.bfloat16
    cache_k, _ = draw(35, K, S, E, dtype=dtype)
    cache_v, _ = draw(36, K, S, E, dtype=dtype)
    cache_k[:, p + 1:], cache_v[:, p + 1:] = float("nan"), float("nan")
    q, _ = draw(37, 1, H, E, dtype=dtype)
    position = torch.tensor([p], device="cuda")
    for _ in range(3):  # repeated launches reuse the fused combine's counters
        got = decode_attention_fwd(q, cache_k, cache_v, position, split_len=split_len, config=dict(config))
        check(f"decode_attention {config} split {split_len} @{p}/{S}", got, attention64(q, cache_k, cache_v,
                                                                                         position), ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,K,E", HEADS)
def test_cross_attention(dtype, H, K, E):
    T, N = 17, 1601
    q, qn = draw(40, T, H, E, dtype=dtype)
    k, kn = draw(41, K, N, E, dtype=dtype)
    v, vn = draw(42, K, N, E, dtype=dtype)
    mask = np.random.default_rng(0).random((T, N)) < 0.5
    mask[0] = False  # no visible image token: zeros
    got = A.cross_attention(q, k, v, torch.from_numpy(mask).cuda())
    check("cross_attention", got, R.cross_attention(qn, kn, vn, mask), ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_merge(dtype):
    w, wn = draw(50, 2048, 8192, dtype=dtype)
    a, an = draw(51, 16, 8192, dtype=dtype)
    b, bn = draw(52, 2048, 16, dtype=dtype)
    check("lora_merge", A.lora_merge(w, a, b, 2.0), R.lora_merge(wn, an, bn, 2.0),
          dict(atol=1e-4, rtol=1e-5, rel=1e-5) if dtype == torch.float32 else TOL[dtype])


# ---- the decode GEMV at the Llama 3.2 shapes (1B and 3B: qkv, o, gate_up, down) with the fusion each one runs ----
GEMV_SHAPES = [(3072, 2048, "norm"), (2048, 2048, "residual"), (16384, 2048, "norm"), (2048, 8192, "swiglu"),
               (5120, 3072, "norm"), (3072, 3072, "residual"), (16384, 3072, "norm"), (3072, 8192, "swiglu")]
GEMV_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4, rel=1e-5),  # fp32 sums over K <= 8192 terms
            torch.bfloat16: TOL[torch.bfloat16]}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,fusion", GEMV_SHAPES)
def test_gemv_at_llama_shapes(dtype, N, K, fusion):
    """Oracle: f(x) by the unfused torch ops in the same dtype (the same roundings), then a float64 product;
    with the residual the product is rounded to the dtype before the add, as the unfused model does."""
    from accel.kernels.gemv import gemv_fwd
    from accel.ops.torch_ops import torch_rms_norm, torch_swiglu_gate_up
    w, _ = draw(60, N, K, dtype=dtype, scale=K ** -0.5)  # outputs O(1)
    x, _ = draw(61, 1, 2 * K if fusion == "swiglu" else K, dtype=dtype, scale=3.0)
    nw, _ = draw(62, K, dtype=dtype)
    r, _ = draw(63, 1, N, dtype=dtype)
    if fusion == "norm":
        got, fx = gemv_fwd(w, x, norm_weight=nw, eps=1e-5), torch_rms_norm(x, nw, 1e-5)
    elif fusion == "swiglu":
        out = r.clone()
        got, fx = gemv_fwd(w, x, swiglu=True, residual=out, out=out), torch_swiglu_gate_up(x)
    else:
        out = r.clone()
        got, fx = gemv_fwd(w, x, residual=out, out=out), x
    want = fx.double() @ w.double().T  # [1, K] @ [K, N] -> [1, N]
    if fusion != "norm":
        want = want.to(dtype).double() + r.double()
    check(f"gemv.{fusion}", got, want, GEMV_TOL[dtype])


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("S", [4096, 32768])
def test_decode_attention_combine_paths_repeated(fused, S):
    """Both combine paths, 20 launches in a row on fresh queries and positions (a race in the fused path's
    last-program combine would show as a wrong or moving result), bf16 at the 1B's heads."""
    from accel.kernels.decode_attn import decode_attention_fwd
    H, K, E = 32, 8, 64
    cache_k, _ = draw(60, K, S, E, dtype=torch.bfloat16)
    cache_v, _ = draw(61, K, S, E, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(S)
    for i in range(20):
        p = int(torch.randint(0, S, (1,), generator=g))
        q, _ = draw(62 + i, 1, H, E, dtype=torch.bfloat16)
        position = torch.tensor([p], device="cuda")
        out = torch.full_like(q, float("nan"))
        decode_attention_fwd(q, cache_k, cache_v, position, out=out, config=dict(FUSED=fused))
        check(f"decode fused={fused} @{p}/{S}", out, attention64(q, cache_k, cache_v, position),
              ATTN_TOL[torch.bfloat16])


# positions around the blocks and splits (8k: 32 splits of 256 slots; 16k: of 512, 128-slot blocks): 0, inside and
# at the end of a split's first block, right after it, a split's last and first slot, past a block, the last slot
EDGE_POSITIONS = {8192: [0, 5, 255, 256, 511, 512, 512 + 256, 4095, 8191],
                  16384: [0, 5, 127, 128, 511, 512, 512 + 128, 8191, 16383]}


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("S,config,edges", [
    (4096, None, False), (32768, None, False), (32768, dict(PREFETCH=256), False),
    (8192, dict(PREFETCH=64, FUSED=False), False),
    (32768, dict(BLOCK_N=256, num_stages=2, LATE_Q=False), False), (32768, dict(BLOCK_N=64, num_stages=4), False),
    (8192, dict(LATE_Q=True), True), (16384, None, True)])
def test_decode_attention_pdl_behind_qkv_rope(graph, S, config, edges):
    """The decode step's pair, qkv_rope then the PDL-launched decode attention, 8 times (or at each of
    EDGE_POSITIONS) without a sync (eager, or captured once in a CUDA graph and replayed): each attention must see
    the q and the cache slot its qkv_rope has just written (an early read before the dependency wait would see the
    buffers' old contents)."""
    from accel.kernels.decode_attn import decode_attention_fwd
    from accel.kernels.qkv_rope import qkv_rope_fwd
    H, K, E, D = 32, 8, 64, 2048
    steps = len(EDGE_POSITIONS[S]) if edges else 8
    dtype = torch.bfloat16
    cache_k, _ = draw(70, K, S, E, dtype=dtype)
    cache_v, _ = draw(71, K, S, E, dtype=dtype)
    weight, _ = draw(72, (H + 2 * K) * E, D, dtype=dtype, scale=D ** -0.5)
    norm_w, _ = draw(73, D, dtype=dtype)
    cos, _ = draw(74, S, E // 2, dtype=torch.float32)
    sin, _ = draw(75, S, E // 2, dtype=torch.float32)
    xs = [draw(76 + i, 1, D, dtype=dtype)[0] for i in range(steps)]
    picked = EDGE_POSITIONS[S] if edges else torch.randperm(S, generator=torch.Generator().manual_seed(S))[
        :steps].sort().values.tolist()
    positions = [torch.tensor([p], device="cuda") for p in picked]  # distinct: no step overwrites another's slot
    qs = [torch.full((1, H, E), float("nan"), dtype=dtype, device="cuda") for _ in range(steps)]
    outs = [torch.full((1, H, E), float("nan"), dtype=dtype, device="cuda") for _ in range(steps)]

    def step():
        for x, pos, q, out in zip(xs, positions, qs, outs):
            qkv_rope_fwd(weight, x, norm_w, 1e-5, cos, sin, pos, cache_k, cache_v, q_out=q)
            decode_attention_fwd(q, cache_k, cache_v, pos, out=out, config=config and dict(config), pdl=True)

    step()  # compiles, and warms the counters before a capture
    torch.cuda.synchronize()
    for x, q, out in zip(xs, qs, outs):
        x.neg_()  # new q and new k/v in the slot: a read before the wait sees NaN or the first pass's values
        q.fill_(float("nan"))
        out.fill_(float("nan"))
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        g.replay()
    else:
        step()
    torch.cuda.synchronize()
    for pos, q, out in zip(positions, qs, outs):  # positions ascend: later writes leave slots 0..p as they were
        check(f"pdl decode graph={graph} {config} @{int(pos)}/{S}", out, attention64(q, cache_k, cache_v, pos),
              ATTN_TOL[dtype])


@pytest.mark.parametrize("use_desc", [False, True])
def test_flash_attention_e128_pointer_and_tma(use_desc):
    """The 3B's E=128 runs through TMA descriptors by default on Hopper; the pointer path (elsewhere) must agree."""
    from accel.kernels.flash_attn import flash_attention_fwd
    H, K, E, T, S = 24, 8, 128, 1000, 2048
    cache_k = torch.full((K, S, E), float("nan"), dtype=torch.bfloat16, device="cuda")
    cache_v = cache_k.clone()
    k, _ = draw(70, K, T, E, dtype=torch.bfloat16)
    v, _ = draw(71, K, T, E, dtype=torch.bfloat16)
    cache_k[:, 500:500 + T], cache_v[:, 500:500 + T] = k, v
    cache_k[:, :500], cache_v[:, :500] = draw(72, K, 500, E, dtype=torch.bfloat16)[0], draw(73, K, 500, E,
                                                                                          dtype=torch.bfloat16)[0]
    q, _ = draw(74, T, H, E, dtype=torch.bfloat16)
    positions = torch.arange(500, 500 + T, device="cuda")
    got = flash_attention_fwd(q, cache_k, cache_v, positions,
                              config=dict(BLOCK_M=128, BLOCK_N=128 if use_desc else 64, num_warps=8, num_stages=3,
                                          USE_DESC=use_desc))
    check(f"flash E=128 desc={use_desc}", got, attention64(q, cache_k, cache_v, positions), ATTN_TOL[torch.bfloat16])


SPLIT_CONFIGS = [("split", 16, 1024, 4, None), ("split", 8, 2048, 8, None), ("persist", 4, 1024, 4, 384),
                 ("split", 4, 4096, 8, None),  # one masked 4096-wide slice (K = 3072)
                 ("stream", 8, 512, 4, 528, 4), ("stream", 16, 512, 4, 264, 3)]  # cp.async pipeline


@pytest.mark.parametrize("config", SPLIT_CONFIGS)
@pytest.mark.parametrize("N,K,fusion", GEMV_SHAPES)
def test_gemv_variants_at_llama_shapes(N, K, fusion, config):
    """Each kernel kind (split-K with the last-ticket reduce, persistent, streaming), bf16,
    against the float64 oracle of test_gemv_at_llama_shapes; three launches must agree bit for bit (the reduce
    sums in slice order whichever program arrives last)."""
    from accel.kernels.gemv import gemv_fwd
    from accel.ops.torch_ops import torch_rms_norm, torch_swiglu_gate_up
    dtype = torch.bfloat16
    w, _ = draw(64, N, K, dtype=dtype, scale=K ** -0.5)
    x, _ = draw(65, 1, 2 * K if fusion == "swiglu" else K, dtype=dtype, scale=3.0)
    nw, _ = draw(66, K, dtype=dtype)
    r, _ = draw(67, 1, N, dtype=dtype)
    outs = []
    for _ in range(3):
        if fusion == "norm":
            got, fx = gemv_fwd(w, x, norm_weight=nw, eps=1e-5, config=config), torch_rms_norm(x, nw, 1e-5)
        else:
            out = r.clone()
            fx = torch_swiglu_gate_up(x) if fusion == "swiglu" else x
            got = gemv_fwd(w, x, swiglu=fusion == "swiglu", residual=out, out=out, config=config)
        outs.append(got.clone())
    want = fx.double() @ w.double().T  # [1, K] @ [K, N] -> [1, N]
    if fusion != "norm":
        want = want.to(dtype).double() + r.double()
    check(f"gemv.{fusion} {config}", outs[0], want, GEMV_TOL[dtype])
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "repeated launches differ"


def test_gemv_chain_graph_equals_eager():
    """Three GEMVs, each reading the previous one's output (the decode step's dependency pattern; the split
    kernels' arrival counters must be re-armed between launches), replayed from a CUDA graph 10 times: bitwise
    equal to the eager chain, which matches the unfused torch chain."""
    from accel.kernels.gemv import gemv_fwd
    from accel.ops.torch_ops import torch_rms_norm
    w, _ = draw(68, 2048, 2048, dtype=torch.bfloat16, scale=2048 ** -0.5)
    nw, _ = draw(69, 2048, dtype=torch.bfloat16)
    x, _ = draw(70, 1, 2048, dtype=torch.bfloat16, scale=3.0)
    cfgs = [("split", 8, 1024, 4, None), ("split", 16, 512, 4, None), ("persist", 4, 1024, 4, 256)]

    def chain(x):
        y = gemv_fwd(w, x, norm_weight=nw, eps=1e-5, config=cfgs[0])
        y = gemv_fwd(w, x, residual=y, out=y, config=cfgs[1])  # y += W x, in place
        return gemv_fwd(w, y, norm_weight=nw, eps=1e-5, config=cfgs[2])

    eager = chain(x).clone()
    y = torch_rms_norm(x, nw, 1e-5) @ w.T
    y = y + (x @ w.T)
    check("gemv chain", eager, torch_rms_norm(y, nw, 1e-5).double() @ w.double().T, TOL[torch.bfloat16])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = chain(x)
    for _ in range(10):
        got.zero_()
        g.replay()
        assert torch.equal(got, eager)
