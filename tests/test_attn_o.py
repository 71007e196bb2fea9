"""accel/kernels/attn_o.py: the decode attention, o projection and residual add in one launch, against the two
launches it replaces (the same bits under the interpreter: same kernels' math, same sums in the same order) and
against refimpl (attention, then "dequantize with the oracle, then multiply"). On a GPU: the Llama 3.2 1B / 3B
shapes inside a captured CUDA graph replayed at several positions, against the two launches."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from accel import ops  # noqa: E402
from accel.kernels import attn_o  # noqa: E402
from accel.kernels.attn_o import attention_o_fwd, attention_o_qfwd, chained_launch  # noqa: E402
from accel.kernels.decode_attn import LONG_CONTEXT, decode_attention_fwd  # noqa: E402
from accel.kernels.gemv import gemv_fwd  # noqa: E402
from accel.kernels.qgemv import qgemv_fwd  # noqa: E402
from accel.kernels.tuning import Tuning  # noqa: E402
from accel.quant_ops import from_quantized_linear  # noqa: E402
from refimpl.model import ops as R  # noqa: E402
from refimpl.quant.schemes import QuantSpec  # noqa: E402

CUDA = torch.cuda.is_available()
interpreter = pytest.mark.skipif(CUDA or not ops.INTERPRET, reason="CPU-interpreter coverage; the GPU's is below")
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def _inputs(rng, H, K, E, S, D):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return f(1, H, E), f(K, S, E), f(K, S, E), f(D, H * E) * 0.1, f(1, D)


def _two_launches(q, ck, cv, pos, w, x, split_len):
    """Today's path: decode_attention_fwd, then the GEMV with the residual epilogue (in place on a copy of x)."""
    a = decode_attention_fwd(q, ck, cv, pos, split_len=split_len).reshape(1, -1)
    r = x.clone()
    if isinstance(w, torch.Tensor):
        return gemv_fwd(w, a, residual=r, out=r)
    return qgemv_fwd(w.q, w.scale, w.low, w.bits, w.offset, w.group, w.K, a, residual=r, out=r)


def _chained(q, ck, cv, pos, w, x, split_len):
    r = x.clone()
    if isinstance(w, torch.Tensor):
        return attention_o_fwd(q, ck, cv, pos, w, r, split_len=split_len)
    return attention_o_qfwd(q, ck, cv, pos, w.q, w.scale, w.low, w.bits, w.offset, w.group, w.K, r,
                            split_len=split_len)


@interpreter
@pytest.mark.parametrize("H,K,E", [(2, 2, 16), (4, 2, 24), (8, 2, 16)])  # GQA ratios 1, 2, 4; E = 24: masked lanes
@pytest.mark.parametrize("weight", ["int8", "int4:32", "dense"])
def test_one_launch_equals_the_two_bit_for_bit_and_refimpl(H, K, E, weight):
    """37 output rows (not a row-block multiple); 40 slots in 16-slot splits (the last one partial); positions at
    the start, inside a split and at the last slot; three launches in a row reuse the zeroed counters."""
    rng = np.random.default_rng([H, K, E, len(weight)])
    S, D = 40, 37
    q, ck, cv, w, x = _inputs(rng, H, K, E, S, D)
    if weight == "dense":
        wt, w_oracle = torch.from_numpy(w), w
    else:
        rec = QuantSpec.parse(weight).quantize(w)
        wt, w_oracle = from_quantized_linear(rec, "cpu"), rec.dequantize()
    for p in (0, 23, 39):
        args = (torch.from_numpy(q), torch.from_numpy(ck), torch.from_numpy(cv), torch.tensor([p]), wt,
                torch.from_numpy(x), 16)
        got = _chained(*args)
        assert torch.equal(got, _two_launches(*args)), f"position {p}: not the two launches' bits"
        attn = R.attention(q, ck[:, p][None], cv[:, p][None], ck.copy(), cv.copy(), np.array([p]))  # [1, H, E]
        want = x + attn.reshape(1, -1).astype(np.float64) @ w_oracle.T.astype(np.float64)  # [1, H·E] @ [H·E, D]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
        assert not attn_o.chain_counters(torch.device("cpu"), K).any(), "counters not returned to 0"


@interpreter
@pytest.mark.parametrize("weight", ["int4:32", "dense"])
def test_the_op_runs_either_way_and_falls_back_to_the_two_ops(weight):
    """ops.attention_o_add: the one launch, the two launches and the torch ops agree; the switch picks (default:
    the two launches)."""
    rng = np.random.default_rng(7)
    H, K, E, S, D = 4, 2, 16, 48, 21
    q, ck, cv, w, x = (torch.from_numpy(a) for a in _inputs(rng, H, K, E, S, D))
    wt = torch.from_numpy(w.numpy()) if weight == "dense" else from_quantized_linear(
        QuantSpec.parse(weight).quantize(w.numpy()), "cpu")
    pos, tuning = torch.tensor([30]), Tuning(decode_attention={"split_len": 16})
    assert not attn_o.chained()
    with chained_launch(True):
        assert attn_o.chained()
    results = {}
    for on in (True, False):
        with chained_launch(on):
            r = x.clone()
            assert ops.attention_o_add(q, ck, cv, pos, wt, r, tuning) is r
            results[on] = r
    assert torch.equal(results[True], results[False])
    with ops.torch_only():
        r = ops.attention_o_add(q, ck, cv, pos, wt, x.clone(), tuning)
    torch.testing.assert_close(results[True], r, rtol=1e-5, atol=1e-5)


def _bf16_case(H, K, E, D, S, weight, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    f = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    q, ck, cv, x = f(1, H, E), f(K, S, E), f(K, S, E), f(1, D)
    w = (f(D, H * E).float() * 0.05).to(torch.bfloat16)
    if weight != "bf16":
        rec = QuantSpec.parse(weight).quantize(w.float().cpu().numpy())
        w = from_quantized_linear(rec, "cuda")
    return q, ck, cv, w, x


@gpu
@pytest.mark.parametrize("model", ["1b", "3b"])
@pytest.mark.parametrize("weight", ["int8", "int4:64", "bf16"])
@pytest.mark.parametrize("S", [288, LONG_CONTEXT])
def test_one_launch_in_a_cuda_graph_at_llama_shapes(model, weight, S):
    """Captured once, replayed at short and long positions (the graph reads the position on the device); each
    replay against the two launches (o's warps may differ: within a bf16 rounding of o), counters back to 0."""
    H, K, E, D = (32, 8, 64, 2048) if model == "1b" else (24, 8, 128, 3072)
    q, ck, cv, w, x0 = _bf16_case(H, K, E, D, S, weight, seed=S + len(weight))
    pos = torch.tensor([0], device="cuda")
    x = x0.clone()
    with chained_launch(True):
        ops.attention_o_add(q, ck, cv, pos, w, x)  # warm-up: compiles, allocates the counters and scratch
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x.copy_(x0)
            ops.attention_o_add(q, ck, cv, pos, w, x)
    for p in (0, 17, S // 2 + 3, S - 1):
        pos.fill_(p)
        graph.replay()
        for _ in range(2):  # replays in a row: the counters must come back zeroed
            graph.replay()
        torch.cuda.synchronize()
        with chained_launch(False):
            want = ops.attention_o_add(q, ck, cv, pos, w, x0.clone())
        o_got, o_want = (x.float() - x0.float()), (want.float() - x0.float())
        err = (o_got - o_want).abs().max().item()
        assert err <= 2 ** -6 * o_want.abs().max().item() + 2 ** -6 * x0.float().abs().max().item(), (p, err)
        assert torch.isfinite(x).all()
    assert not attn_o.chain_counters(torch.device("cuda"), K).any()


def test_bench_o_tiles_replace_the_config_and_restore_it():
    """tools.bench.attn_o.o_tiles: o's tiles inside the one launch replaced for a variant, the rule back after."""
    from tools.bench.attn_o import o_tiles
    rule = attn_o.attn_o_config
    with o_tiles((4, 64, 1, 2, 1)):
        assert tuple(attn_o.attn_o_config(2048, 2048, 8, 2048, 132)) == (4, 64, 1, 2, 1, 0)
    assert attn_o.attn_o_config is rule
    assert attn_o.attn_o_config(2048, 2048, 8, 2048, 132).programs == 0
