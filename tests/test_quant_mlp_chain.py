"""The quantized decode MLP as one chained launch (accel.kernels.qmlp.norm_mlp_qfwd, accel.quant_ops.mlp_chained)
against the two kernels it chains (gate_up_swiglu_qfwd, then qgemv_fwd's down with the residual epilogue) and the
oracle "dequantize with refimpl, norm, gate_up, silu(gate)·up, down, add".

Both phases run the two kernels' helpers with the same tiles, so the chained launch must equal them bit for bit
where its num_warps is theirs (num_warps sets each row's fp32 reduction tree): always under the interpreter, and on
the GPU with both references launched at the chained launch's warps. On the GPU (skipped without CUDA) at the
Llama 3.2 1B / 3B MLP shapes, eager and inside a captured CUDA graph replayed several times (the counters must come
back to 0 for each replay to wait correctly).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from accel import ops  # noqa: E402
from accel.kernels import chain  # noqa: E402
from accel.kernels.qgemv import qgemv_fwd  # noqa: E402
from accel.kernels.qgemv_fused import gate_up_swiglu_qfwd  # noqa: E402
from accel.kernels.qmlp import _CNT_AT, _CNT_N, mlp_configs, norm_mlp_qfwd  # noqa: E402
from accel.kernels.tuning import QMlpConfig  # noqa: E402
from accel.quant_ops import QuantTensor, from_quantized_linear, mlp_chained, quantize  # noqa: E402
from refimpl.model import ops as np_ops  # noqa: E402
from refimpl.quant.schemes import QuantSpec  # noqa: E402
from test_quant_accel import gpu, interpreter, record  # noqa: E402

EPS = 1e-5


def parts(t: QuantTensor) -> tuple:
    return t.q, t.scale, t.low, t.group


def two_kernels(gu: QuantTensor, down: QuantTensor, x, nw, gcfg, dcfg, pdl="default"):
    """The path the chained launch replaces: gate_up + SwiGLU -> h, then x += down(h)."""
    h = gate_up_swiglu_qfwd(gu.q, gu.scale, gu.low, gu.bits, gu.offset, gu.group, gu.K, x, nw, EPS, config=gcfg,
                            pdl=pdl)
    return qgemv_fwd(down.q, down.scale, down.low, down.bits, down.offset, down.group, down.K, h, residual=x, out=x,
                     config=dcfg, pdl=pdl)


def counters(dev):
    """The chained launch's counters: all zero between launches."""
    return chain.chain_counters(torch.device(dev), _CNT_AT + _CNT_N)[_CNT_AT:_CNT_AT + _CNT_N].count_nonzero().item()


@interpreter
@pytest.mark.parametrize("spec, F, split", [("int8", 37, 1), ("int8", 37, 3), ("int4:32", 38, 3), ("int4:64", 38, 1),
                                            ("int4:64", 38, 3), ("q4_0", 64, 2)])
def test_chained_mlp_equals_the_two_kernels_and_the_oracle(spec, F, split):
    D = 40 if spec != "q4_0" else 64  # GGUF: whole 32-column blocks along both K
    gu_rec, down_rec = record(spec, 2 * F, D, seed=3), record(spec, D, F, seed=4)
    gu, down = from_quantized_linear(gu_rec, "cpu"), from_quantized_linear(down_rec, "cpu")
    chunk = 128 // gu.bits
    gcfg = (8, 2 * chunk, 4, 1, 2)  # 4 gate / 4 up rows a block: F = 37 or 38 leaves a ragged last block
    dcfg = (8, chunk, 4, split, 1)  # D = 40: 5 row blocks; K slices of whole tiles (the last one short)
    rng = np.random.default_rng(5)
    nw = torch.from_numpy((1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    for rep in range(2):  # the second launch finds the counters zeroed
        x0 = torch.from_numpy((3 * rng.standard_normal((1, D))).astype(np.float32))
        x = x0.clone()
        got = norm_mlp_qfwd(parts(gu), parts(down), gu.bits, gu.offset, x, nw, EPS, config=(gcfg, dcfg, QMlpConfig(4)))
        assert got is x
        want = two_kernels(gu, down, x0.clone(), nw, gcfg, dcfg)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"rep {rep}: not bit for bit"
        assert counters("cpu") == 0
        h = np_ops.rms_norm(x0.numpy(), nw.numpy(), EPS)  # [1, D]
        g_u = h @ gu_rec.dequantize().T  # [1, D] @ [D, 2F] -> [1, 2F]
        oracle = x0.numpy() + np_ops.swiglu(g_u[:, :F], g_u[:, F:]) @ down_rec.dequantize().T  # [1, F] @ [F, D]
        np.testing.assert_allclose(got.numpy(), oracle, rtol=1e-5, atol=1e-4)


def _count_chained_calls(monkeypatch) -> list:
    """Calls of the chained kernel's launcher from here on (a spy around accel.kernels.qmlp.norm_mlp_qfwd)."""
    from accel.kernels import qmlp
    calls, real = [], qmlp.norm_mlp_qfwd
    monkeypatch.setattr(qmlp, "norm_mlp_qfwd", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@interpreter
@pytest.mark.parametrize("spec", ["int8", "int4:64"])
def test_norm_mlp_add_chained_or_not_is_the_same(spec, monkeypatch):
    """The op the engine calls, with the switch on and off: the same bits (the default tiles of both paths), and
    the chained kernel ran only with it on."""
    calls = _count_chained_calls(monkeypatch)
    F, D = 38, 64
    gu = from_quantized_linear(record(spec, 2 * F, D, seed=9), "cpu")
    down = from_quantized_linear(record(spec, D, F, seed=10), "cpu")
    rng = np.random.default_rng(11)
    x0 = torch.from_numpy((3 * rng.standard_normal((1, D))).astype(np.float32))
    nw = torch.from_numpy((1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    outs = []
    for on in (True, False):
        with mlp_chained(on):
            outs.append(ops.norm_mlp_add(x0.clone(), nw, gu, down, EPS))
        assert len(calls) == 1, (on, calls)
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
    assert counters("cpu") == 0


@interpreter
def test_quantized_engine_steps_equal_chained_or_not(tmp_path, monkeypatch):
    """A toy int4:32 model's decode step on the accel engine (CPU, fp32): the same logits, bit for bit, with its
    MLPs chained and as two kernels."""
    from accel.engine import AccelEngine
    from refimpl.formats.params import Checkpoint, random_params
    from test_gguf import tiny_config
    cfg = tiny_config(tied=True)
    dense = Checkpoint(tmp_path, cfg, random_params(cfg, seed=10, std=0.15))
    logits = []
    calls = _count_chained_calls(monkeypatch)
    for on in (True, False):
        with mlp_chained(on):
            eng = AccelEngine.from_checkpoint(dense, device="cpu", dtype="fp32", quant=QuantSpec.parse("int4:32"))
            sess = eng.session(8)
            eng.prefill([3, 17, 42, 5], sess)  # more than one row: the MLP's two kernels either way
            logits.append(sess.decoder.step(torch.tensor([7]), 4))
    assert len(calls) == cfg.num_hidden_layers, calls  # the chained kernel ran in every layer of the step with it on
    assert torch.equal(logits[0].view(torch.int32), logits[1].view(torch.int32))


@gpu
@pytest.mark.parametrize("spec", ["int8", "int4:64"])
@pytest.mark.parametrize("F, D", [(8192, 2048), (8192, 3072)])
def test_chained_mlp_at_llama_shapes_in_a_graph_gpu(spec, F, D):
    g = torch.Generator(device="cuda").manual_seed(0)
    gu = quantize(torch.randn(2 * F, D, device="cuda", generator=g) * 0.02, QuantSpec.parse(spec))
    down = quantize(torch.randn(D, F, device="cuda", generator=g) * 0.02, QuantSpec.parse(spec))
    nw = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
    xs = [torch.randn(1, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4)]
    gcfg, dcfg, launch = mlp_configs(2 * F, D, F, gu.bits, gu.group, down.group, 132)
    warps = launch.warps
    run = lambda x: norm_mlp_qfwd(parts(gu), parts(down), gu.bits, gu.offset, x, nw, EPS)  # noqa: E731
    # the references at the chained launch's warps: the same reduction trees, so the same bits
    refs = [two_kernels(gu, down, x.clone(), nw, gcfg._replace(warps=warps), dcfg._replace(warps=warps))
            for x in xs]
    # and as the step runs them (each at its own table warps): one fp32 summation order apart at most
    own = two_kernels(gu, down, xs[0].clone(), nw, None, None)
    assert (own.double() - refs[0].double()).abs().max().item() <= 2 ** -7 * refs[0].double().abs().max().item()
    x = xs[0].clone()
    assert torch.equal(run(x), refs[0])  # eager, and the warm-up before the capture
    static = torch.empty_like(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(static)
    for i in (1, 2, 3, 0, 2):  # several replays, each finding the counters back at 0
        static.copy_(xs[i])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, refs[i]), f"replay of input {i}"
    assert counters("cuda") == 0
