"""The quantized decode step's programmatic dependent launch (accel/kernels/qgemv.py, module doc "PDL"), on CUDA
(skipped without it: the CPU interpreter compiles PDL out, and tests/test_quant_accel.py covers the kernels there).

A PDL-launched kernel may run its start while the kernel before it still runs; it must read x, the residual, the
norm's input and the split-K scratch only after its dependency wait. Each test runs the kernels without a sync,
with NaN (or the previous pass's values) in every buffer a kernel reads from its predecessor until that
predecessor writes it, and compares bit for bit with plain launches: the arithmetic is the same, so a read before
the wait is the only way to differ.
"""
import dataclasses

import pytest

torch = pytest.importorskip("torch")

from accel.engine import AccelEngine  # noqa: E402
from accel.kernels.qgemv import QGemvConfig, qgemv_fwd  # noqa: E402
from accel.kernels.qgemv_fused import qkv_rope_qfwd  # noqa: E402
from accel.kernels.tuning import QGEMV_PDL, Tuning  # noqa: E402
from accel.quant_layers import quantize_weights  # noqa: E402
from accel.quant_ops import quantize  # noqa: E402
from accel.weights import random_weights  # noqa: E402
from refimpl.model.config import PRESETS  # noqa: E402
from refimpl.quant.schemes import QuantSpec  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MODES = [QGEMV_PDL[4], QGEMV_PDL[8]]  # the launch modes the engine runs (by code width)
H, NKV, E, D, F, V, S = 32, 8, 64, 2048, 8192, 128256, 64  # Llama 3.2 1B


def _layer(spec, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mat(n, k):
        return quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02, QuantSpec.parse(spec))
    norms = [(1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16) for _ in range(2)]
    return dict(qkv=mat((H + 2 * NKV) * E, D), o=mat(D, H * E), gate_up=mat(2 * F, D), down=mat(D, F),
                attn_norm=norms[0], mlp_norm=norms[1])


def _args(t):
    return t.q, t.scale, t.low, t.bits, t.offset, t.group, t.K


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("spec", ["int8", "int4:64"])
@pytest.mark.parametrize("mode", MODES, ids=[f"{m.trigger}-prefetch{m.prefetch}" for m in MODES])
def test_quantized_decode_kernels_read_their_inputs_after_the_wait(graph, spec, mode):
    """Two layers' kernels (qkv + RoPE + cache write, o + residual with 4 K slices, gate_up with the norm, down
    with SwiGLU + residual, its K slices sharing the split-K scratch with o's) and the lm_head, at the 1B's shapes,
    four passes without a sync (eager, or captured once and replayed), each pass starting from NaN in q, gate_up
    and the logits and a new x: bit for bit the values of plain launches (the attention is left out: o reads q)."""
    layers = [_layer(spec, seed) for seed in (1, 2)]
    g = torch.Generator(device="cuda").manual_seed(3)
    head = quantize(torch.randn(V, D, device="cuda", generator=g) * 0.02, QuantSpec.parse(spec))
    final_norm = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
    ang = torch.randn(S, E // 2, device="cuda", generator=g)
    cos, sin = ang.cos(), ang.sin()
    passes = 4
    x0 = [torch.randn(1, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(passes)]
    positions = [torch.tensor([5 + 7 * i], device="cuda") for i in range(passes)]
    o_split = QGemvConfig(16, 512, 2, 4, 1)  # 4 K slices of 512 columns at either width

    def buffers():
        return dict(x=torch.empty(passes, 1, D, device="cuda", dtype=torch.bfloat16),
                    q=torch.empty(passes, 1, H, E, device="cuda", dtype=torch.bfloat16),
                    gu=torch.empty(passes, 1, 2 * F, device="cuda", dtype=torch.bfloat16),
                    logits=torch.empty(passes, 1, V, device="cuda", dtype=torch.bfloat16),
                    ck=torch.zeros(2, NKV, S, E, device="cuda", dtype=torch.bfloat16),
                    cv=torch.zeros(2, NKV, S, E, device="cuda", dtype=torch.bfloat16))

    def run(b, pdl):
        for i in range(passes):
            x, q, gu, logits = b["x"][i], b["q"][i], b["gu"][i], b["logits"][i]
            for t in (q, gu, logits):
                t.fill_(float("nan"))  # a kernel reading these before its wait sees NaN
            x.copy_(x0[i])
            for j, lw in enumerate(layers):
                qkv_rope_qfwd(*_args(lw["qkv"]), x, lw["attn_norm"], 1e-5, cos, sin, positions[i], b["ck"][j],
                              b["cv"][j], q_out=q, pdl=pdl)
                qgemv_fwd(*_args(lw["o"]), q.view(1, H * E), residual=x, out=x, config=o_split, pdl=pdl)
                qgemv_fwd(*_args(lw["gate_up"]), x, norm_weight=lw["mlp_norm"], eps=1e-5, out=gu, pdl=pdl)
                qgemv_fwd(*_args(lw["down"]), gu, swiglu=True, residual=x, out=x, pdl=pdl)
            qgemv_fwd(*_args(head), x, norm_weight=final_norm, eps=1e-5, out=logits, pdl=pdl)

    want = buffers()
    run(want, None)
    got = buffers()
    run(got, mode)  # compiles, and grows the split-K scratch before a capture
    torch.cuda.synchronize()
    if graph:
        got = buffers()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            run(got, mode)
        for _ in range(2):
            got["ck"].zero_(), got["cv"].zero_()
            cg.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(want["logits"]).all()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs with {mode} (graph={graph})"


@pytest.mark.parametrize("spec", ["int8", "int4:64"])
def test_quantized_engine_decode_with_pdl_equals_plain_launches(spec):
    """The engine's captured decode step (two layers at the 1B's shapes): greedy tokens and the logits of every
    step bit for bit the same with and without PDL."""
    cfg = dataclasses.replace(PRESETS["llama-3.2-1b"], num_hidden_layers=2)
    weights = quantize_weights(random_weights(cfg, "cuda", torch.bfloat16, seed=4), QuantSpec.parse(spec))
    prompt = [128000, 791, 4062, 14198, 39935, 35308, 927, 279]
    results = []
    for tuning in (Tuning(qgemv_pdl={4: None, 8: None}), Tuning()):  # plain launches, then the default modes
        eng = AccelEngine(cfg, weights, torch.device("cuda"), "bf16", tuning=tuning)
        sess = eng.session(len(prompt) + 12)
        logits = [eng.prefill(prompt, sess).float().clone()]
        tok = int(logits[0].argmax())
        for i in range(10):  # graph replays
            logits.append(sess.decoder.step(torch.tensor([tok], device="cuda"), len(prompt) + i).float().clone())
            tok = int(logits[-1].argmax())
        results.append(torch.cat(logits))
        del eng, sess
    assert torch.isfinite(results[0]).all()
    assert torch.equal(results[0], results[1])
