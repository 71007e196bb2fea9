"""accel's quantized weights against the oracle (refimpl.quant): quantize and dequantize bit for bit, the
quantized GEMV against "dequantize with the oracle, then multiply", and quantized models end to end.

On CPU the Triton kernels run under the interpreter (fp32); on CUDA the bit checks repeat on the device. The
GPU-only tests (the Llama 3.2 shapes in bf16, the engine on the device) are tests/test_quant_accel_gpu.py.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from accel.engine import AccelEngine  # noqa: E402
from accel.kernels.qgemv import QGemvConfig  # noqa: E402
from accel.quant_ops import from_quantized_linear, quantize  # noqa: E402
from refimpl.compare import TOLERANCES, compare  # noqa: E402
from refimpl.formats.checkpoint import load_checkpoint  # noqa: E402
from refimpl.formats.params import Checkpoint, random_params  # noqa: E402
from refimpl.generate import RefEngine, Sampling  # noqa: E402
from refimpl.model import ops as np_ops  # noqa: E402
from refimpl.quant.apply import quantize_params  # noqa: E402
from refimpl.quant.schemes import QuantizedLinear, QuantSpec  # noqa: E402
from test_gguf import tiny_config, write_gguf  # noqa: E402
from test_quant_refimpl import edge_blocks  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
# Triton on CPU tensors needs the interpreter, which conftest turns on only where there is no GPU
interpreter = pytest.mark.skipif(CUDA, reason="CPU-interpreter coverage; the GPU's is below")
DEV = "cuda" if CUDA else "cpu"  # the odd-shape GEMV tests: the interpreter here, the device's kernels there
INT_SPECS = ["int8", "int4:32", "int4:64", "int4:128"]
Q = gguf.GGMLQuantizationType


def weights(N, K, seed=0):
    return (np.random.default_rng(seed).standard_normal((N, K)) * 0.05).astype(np.float32)


def gguf_record(fmt, N, K, seed=0, edges=False) -> QuantizedLinear:
    """GGUF blocks as a file stores them: quantized by the gguf library, or random bytes with edge fp16 fields."""
    if edges:
        data = edge_blocks(fmt, np.random.default_rng(seed), N * K // 32).reshape(N, -1)
    else:
        data = gguf.quants.quantize(weights(N, K, seed), getattr(Q, fmt.upper()))
    return QuantizedLinear(fmt, (N, K), data, None, None, 32)


def record(fmt, N, K, seed=0) -> QuantizedLinear:
    """int8 / int4:G by refimpl's quantizer, GGUF blocks as the gguf library writes them."""
    return QuantSpec.parse(fmt).quantize(weights(N, K, seed)) if fmt.startswith("int") else gguf_record(fmt, N, K, seed)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("spec", INT_SPECS)
def test_quantize_and_dequantize_equal_the_oracle_bit_for_bit(spec, device):
    w = weights(37, 200)  # 200: a short last group for G = 64 and 128
    w[3] = 0  # a zero row: scale 0, codes 0
    w[5, :40] = 0.01  # a constant group
    ref = QuantSpec.parse(spec).quantize(w)
    t = quantize(torch.from_numpy(w).to(device), QuantSpec.parse(spec))
    np.testing.assert_array_equal(t.q.cpu().numpy(), ref.data)
    np.testing.assert_array_equal(bits(t.scale.float().cpu().numpy()), bits(ref.scales))
    if ref.mins is not None:
        np.testing.assert_array_equal(bits(t.low.float().cpu().numpy()), bits(ref.mins))
    np.testing.assert_array_equal(bits(t.dequantize().cpu().numpy()), bits(ref.dequantize()))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("edges", [False, True], ids=["quantized", "edge-blocks"])
def test_gguf_blocks_dequantize_to_the_oracle_bit_for_bit(fmt, edges, device):
    ref = gguf_record(fmt, 11, 96, seed=1, edges=edges)
    t = from_quantized_linear(ref, device)
    np.testing.assert_array_equal(bits(t.dequantize().cpu().numpy()), bits(ref.dequantize()))


def records():
    """One of each format at odd shapes: 37 rows (not a row block multiple), K not a power of two."""
    out = {spec: QuantSpec.parse(spec).quantize(weights(37, 200, seed=2)) for spec in INT_SPECS}
    out.update({fmt: gguf_record(fmt, 37, 160, seed=3) for fmt in ("q8_0", "q4_0", "q4_1")})
    out["int4:64 (G > K)"] = QuantSpec.parse("int4:64").quantize(weights(37, 48, seed=2))  # one short group a row
    out["int8 (K = 202)"] = QuantSpec.parse("int8").quantize(weights(37, 202, seed=2))  # rows not whole words
    return out


RECORDS = records()


def oracle_product(rec: QuantizedLinear, x: np.ndarray) -> np.ndarray:
    return rec.dequantize().astype(np.float64) @ x.astype(np.float64)  # [N, K] @ [K] -> [N]


def check_fp32(got, want, rec, x):
    """Within fp32 summation error: |Σ w·x| rounding is bounded by K·eps·Σ|w·x|."""
    bound = 4 * rec.shape[1] * 2.0 ** -24 * (np.abs(rec.dequantize()) @ np.abs(x)) + 1e-7
    assert (np.abs(got - want) <= bound).all(), f"max excess {np.max(np.abs(got - want) - bound):.3g}"


def gemv_on(t, x, **kw) -> np.ndarray:
    """qgemv on DEV from NumPy inputs (tensor keyword arguments moved there too) -> [N] fp32."""
    kw = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    return t.gemv(torch.from_numpy(x)[None].to(DEV), **kw)[0].cpu().numpy()


@pytest.mark.parametrize("name", list(RECORDS))
@pytest.mark.parametrize("fusion", ["plain", "norm", "swiglu", "residual"])
def test_quantized_gemv_is_dequantize_then_multiply(name, fusion):
    rec = RECORDS[name]
    N, K = rec.shape
    t = from_quantized_linear(rec, DEV)
    rng = np.random.default_rng(4)
    x = rng.standard_normal(2 * K if fusion == "swiglu" else K).astype(np.float32)
    r = rng.standard_normal(N).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    kw, fx = {}, x
    if fusion == "norm":
        kw, fx = dict(norm_weight=torch.from_numpy(nw), eps=1e-5), np_ops.rms_norm(x[None], nw, 1e-5)[0]
    elif fusion == "swiglu":
        kw, fx = dict(swiglu=True), np_ops.swiglu(x[None, :K], x[None, K:])[0]
    elif fusion == "residual":
        kw = dict(residual=torch.from_numpy(r.copy()))
    got = gemv_on(t, x, **kw)
    want = oracle_product(rec, fx) + (r if fusion == "residual" else 0)
    check_fp32(got, want, rec, fx)


@pytest.mark.parametrize("name", ["int8", "int4:32", "q4_1"])
def test_quantized_gemv_split_k_sums_slices_in_order(name):
    rec = RECORDS[name]
    t = from_quantized_linear(rec, DEV)
    x = np.random.default_rng(5).standard_normal(rec.shape[1]).astype(np.float32)
    cfg = QGemvConfig(16, 64 if t.group < t.K else 32, 4, 2, 1)  # two K slices (and a ragged last one)
    got = gemv_on(t, x, config=cfg)
    check_fp32(got, oracle_product(rec, x), rec, x)


@pytest.mark.parametrize("name", ["int4:32", "int4:64", "q4_0", "q4_1", "int8", "int4:64 (G > K)"])
@pytest.mark.parametrize("fusion", ["norm", "residual"])
def test_persistent_quantized_gemv_is_dequantize_then_multiply(name, fusion):
    """Persistent programs (QGemvConfig.programs): 2 programs over the 5 row blocks of 8 rows (the last ragged),
    f(x) built once a program, the epilogue a block."""
    rec = RECORDS[name]
    N, K = rec.shape
    t = from_quantized_linear(rec, DEV)
    rng = np.random.default_rng(12)
    x = rng.standard_normal(K).astype(np.float32)
    r = rng.standard_normal(N).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    kw, fx = dict(residual=torch.from_numpy(r.copy())), x
    if fusion == "norm":
        kw, fx = dict(norm_weight=torch.from_numpy(nw), eps=1e-5), np_ops.rms_norm(x[None], nw, 1e-5)[0]
    got = gemv_on(t, x, config=QGemvConfig(8, 1 << (K - 1).bit_length(), 4, 1, 2, 2), **kw)
    check_fp32(got, oracle_product(rec, fx) + (r if fusion == "residual" else 0), rec, fx)


@pytest.mark.parametrize("name", ["int8", "int4:32", "q8_0", "q4_0"])
def test_quantized_gemv_holds_over_a_wide_range_of_inputs(name):
    """f(x) meets the codes as each 16-byte chunk's fixed point, scaled by the chunk's largest |f(x)|: values 2^20
    apart inside chunks, a chunk of zeros and one of values near 2^-110 stay within the fp32 summation bound."""
    rec = RECORDS[name]
    K = rec.shape[1]
    t = from_quantized_linear(rec, DEV)
    rng = np.random.default_rng(6)
    x = rng.standard_normal(K).astype(np.float32)
    x[::7] *= np.float32(2.0 ** 20)  # a spike in every chunk
    x[:32] = 0
    x[32:64] = (rng.standard_normal(32) * 2.0 ** -110).astype(np.float32)
    got = gemv_on(t, x)
    check_fp32(got, oracle_product(rec, x), rec, x)
    small = np.zeros_like(x)
    small[32:64] = x[32:64]  # the tiny chunk alone: its own scale, not the spikes'
    got = gemv_on(t, small)
    want = oracle_product(rec, small)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("name", ["int8", "int4:32", "q8_0", "q4_1"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_input_gives_non_finite_outputs(name, bad):
    """The integer products cannot carry NaN or ±inf: the chunk holding one must not come out finite (the oracle's
    products are ±inf or NaN in every row whose code there is not zero)."""
    rec = RECORDS[name]
    x = np.random.default_rng(7).standard_normal(rec.shape[1]).astype(np.float32)
    x[21] = bad
    with np.errstate(invalid="ignore"):
        want = oracle_product(rec, x)
    got = gemv_on(from_quantized_linear(rec, DEV), x)
    assert (~np.isfinite(want)).any()
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))


@interpreter
@pytest.mark.parametrize("H, NKV, E, D, spec", [(4, 2, 16, 64, "int8"), (3, 1, 24, 96, "int4:32"),
                                                  (2, 2, 64, 160, "q4_1"), (4, 1, 32, 96, "q4_0")])
@pytest.mark.parametrize("block_n", [None, 4])
def test_quantized_qkv_rope_is_dequantize_then_norm_gemv_rope(H, NKV, E, D, spec, block_n):
    """The fused norm -> quantized qkv -> RoPE -> cache write (one token, mid-cache) against the oracle:
    refimpl's dequantized weight, rms_norm, matmul and rope; every other cache slot unchanged. GQA 2/3/1/4, a
    head half (12) that 4-column blocks do not divide, D not a power of 2."""
    from accel.kernels.qgemv_fused import qkv_rope_qfwd
    from refimpl.model.config import RopeScaling
    N = (H + 2 * NKV) * E
    rec = record(spec, N, D, seed=7)
    t = from_quantized_linear(rec, "cpu")
    rng = np.random.default_rng(8)
    S, pos = 9, 5
    x, nw = rng.standard_normal(D).astype(np.float32), (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    cos, sin = np_ops.rope_tables(np.arange(S), E, 500000.0, RopeScaling())  # [S, E/2]
    cache_k, cache_v = rng.standard_normal((2, NKV, S, E)).astype(np.float32)
    got_ck, got_cv = torch.from_numpy(cache_k.copy()), torch.from_numpy(cache_v.copy())
    cfg = None if block_n is None else QGemvConfig(block_n, 64, 4, 1, 1)
    got_q = qkv_rope_qfwd(t.q, t.scale, t.low, t.bits, t.offset, t.group, t.K, torch.from_numpy(x)[None],
                          torch.from_numpy(nw), 1e-5, torch.from_numpy(cos), torch.from_numpy(sin),
                          torch.tensor([pos]), got_ck, got_cv, config=cfg)
    fx = np_ops.rms_norm(x[None], nw, 1e-5)[0]  # [D]
    qkv = oracle_product(rec, fx)  # [(H+2K)·E]
    q, k = qkv[:H * E].reshape(1, H, E), qkv[H * E:(H + NKV) * E].reshape(1, NKV, E)
    want_q, want_k = np_ops.rope(q, k, cos[pos:pos + 1], sin[pos:pos + 1])
    cache_k[:, pos], cache_v[:, pos] = want_k[0], qkv[(H + NKV) * E:].reshape(NKV, E)
    # fp32 sums over D of |w·f(x)| <~ 4: the GEMV bound of check_fp32, and the rotation's few roundings
    tol = dict(atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got_q[0].numpy(), want_q[0], **tol)
    np.testing.assert_allclose(got_ck.numpy(), cache_k, **tol)
    np.testing.assert_allclose(got_cv.numpy(), cache_v, **tol)


def test_qgemv_launch_table_rows_are_launchable():
    """Every row of the measured table (accel/kernels/tuning.py QGEMV) passes the launcher's checks: whole 16-byte
    chunks a tile, chunks inside groups, persistent rows one tile a row, the qkv + RoPE rows unsplit with a
    power-of-2 half block and not persistent."""
    from accel.kernels.qgemv import launch_checks
    from accel.kernels.tuning import QGEMV
    for key, cfg in QGEMV.items():
        N, K, bits, group = key[:4]
        launch_checks(cfg, bits, group, per_row=bits == 8 and group >= K, K=K)
        if key[4:] == ("rope",):
            hn = cfg.block_n // 2
            assert cfg.split_k == 1 and hn & (hn - 1) == 0 and not cfg.programs, key


def tiny_gguf(tmp_path, qtype):
    cfg = tiny_config(tied=True)
    return write_gguf(tmp_path / f"{qtype.name}.gguf", cfg, random_params(cfg, seed=9, std=0.15), qtype=qtype)


@pytest.mark.parametrize("spec", ["int8", "int4:64:bf16-head", "int4:32:mixed", "gguf-q4_0"])
def test_quantized_toy_model_greedy_tokens_refimpl_vs_accel(tmp_path, spec):
    """Greedy tokens and every step's logits of one quantized toy model on both engines (accel fp32, CPU)."""
    if spec.startswith("gguf"):
        path = tiny_gguf(tmp_path, getattr(Q, spec.split("-")[1].upper()))
        ckpt = load_checkpoint(path, with_tokenizer=False, quant=QuantSpec.parse("gguf"))
        acc = AccelEngine.from_checkpoint(ckpt, device="cpu", dtype="fp32")
    else:
        cfg = tiny_config(tied=True)
        dense = Checkpoint(tmp_path, cfg, random_params(cfg, seed=10, std=0.15))
        ckpt = Checkpoint(tmp_path, cfg, quantize_params(dense.params, cfg, QuantSpec.parse(spec)))
        # accel quantizes the fp32 weights itself, on the device: the same bits as the refimpl's records
        acc = AccelEngine.from_checkpoint(dense, device="cpu", dtype="fp32", quant=QuantSpec.parse(spec))
    assert type(acc.weights.layers[0].qkv).__name__ == "QuantTensor"
    if spec.endswith("mixed"):  # int8 q/k/v, down_proj and lm_head beside int4 o and gate/up, in both engines
        lw = acc.weights.layers[0]
        assert [lw.qkv.fmt, lw.o.fmt, lw.gate_up.fmt, lw.down.fmt, acc.weights.lm_head.fmt] == [
            "int8", "int4", "int4", "int8", "int8"]
        assert [ckpt.params[f"model.layers.0.{k}.weight"].format for k in ("self_attn.v_proj", "mlp.up_proj")] == [
            "int8", "int4"]
    ref = RefEngine(ckpt)
    s = Sampling(max_new_tokens=3)
    prompt = [3, 17, 42, 5]
    tokens = list(ref.generate(prompt, s))
    assert list(acc.generate(prompt, s)) == tokens
    torch_ops = AccelEngine(acc.config, acc.weights, acc.device, acc.dtype_name, use_triton=False)
    assert list(torch_ops.generate(prompt, s)) == tokens  # the path without Triton
    ref_cache, acc_cache = ref.new_cache(8), acc.new_cache(8)
    want = ref.logits(prompt, np.arange(4), ref_cache)
    sess = acc.session(8)
    got = acc.to_numpy(acc.prefill(prompt, sess))[0]
    assert compare("logits", got, want, TOLERANCES["fp32"]).ok
    tok = int(np.argmax(want))
    want = ref.logits([tok], [4], ref_cache)
    got = acc.to_numpy(sess.decoder.step(torch.tensor([tok]), 4))[0]
    assert compare("logits", got, want, TOLERANCES["fp32"]).ok
    del acc_cache


def test_launch_modes_constexprs(monkeypatch):
    """On sm_90 (faked: the interpreter compiles PDL out), a PdlMode sets the PDL launch, where the trigger sits
    (1 after the wait, 2 after the main loop) and the prefetched lines (n tiles of a program's row bytes, capped at
    them); None: plain launches, the qkv + RoPE kernel still triggering at its start."""
    from accel.kernels import qgemv
    from accel.kernels.qgemv import pdl_kwargs
    from accel.kernels.tuning import PdlMode, QGemvConfig
    monkeypatch.setattr(qgemv, "pdl_available", lambda t: True)
    cfg, q = QGemvConfig(16, 512, 2, 1, 3), torch.zeros(1)
    assert pdl_kwargs(None, q, cfg, 8, 2048, rope=False) == {}
    assert pdl_kwargs(None, q, cfg, 8, 2048, rope=True) == dict(TRIGGER=1)
    assert pdl_kwargs(PdlMode("late", 1), q, cfg, 8, 2048, rope=False) == dict(
        PDL=True, TRIGGER=2, PF_LINES=4, launch_pdl=True)
    assert pdl_kwargs(PdlMode("wait", 1), q, cfg, 4, 2048, rope=True) == dict(
        PDL=True, TRIGGER=1, PF_LINES=2, launch_pdl=True)
    assert pdl_kwargs(PdlMode("wait", 8), q, cfg, 8, 2048, rope=False)["PF_LINES"] == 16  # the whole row
