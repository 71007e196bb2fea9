"""The segmented multi-LoRA product (accel/kernels/lora_sgmv.py under the Triton interpreter on CPU, and its torch
version) against a plain per-row NumPy loop, against PEFT's own LoRA layer, and the stacked adapters
(accel/lora_stack.py) against the refimpl's merged weights (refimpl.formats.lora.merge_lora, itself checked
against PEFT in tests/test_lora.py)."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from accel.kernels.lora_sgmv import lora_sgmv_fwd, segment_tiles, tiles_tensor  # noqa: E402
from accel.ops import torch_only  # noqa: E402
from accel.ops.lora_batch import lora_sgmv, torch_lora_sgmv  # noqa: E402
from refimpl.compare import TOLERANCES, compare  # noqa: E402


def assert_close(got, want, dtype="fp32", name="y"):
    """refimpl.compare's per-dtype tolerance (NMSE and max error relative to the reference's largest value)."""
    c = compare(name, np.asarray(got, np.float64), np.asarray(want, np.float64), TOLERANCES[dtype])
    assert c.ok, f"{name}: max_abs {c.max_abs:.3g} at {c.worst}, nmse {c.nmse:.3g} ({dtype} tolerance)"


def lora_sgmv_rows(y, x, lora_a, lora_b, scales, adapter_per_row):
    """lora_sgmv with an adapter index a row (-1: none) instead of tiles, as LoraStack.tiles builds them."""
    return lora_sgmv(y, x, lora_a, lora_b, scales, tiles_tensor(segment_tiles(list(adapter_per_row)), x.device))


def per_row_reference(y, x, A, B, scales, idx):
    """y[t] + scale[a] · B[a] @ (A[a] @ x[t]) for each row, in float64 NumPy."""
    out = y.astype(np.float64).copy()
    for t, a in enumerate(idx):
        if a >= 0:
            out[t] += scales[a] * (B[a].astype(np.float64) @ (A[a].astype(np.float64) @ x[t]))
    return out


def random_case(T, Din, Dout, ranks, seed=0):
    """N adapters of the given ranks, zero-padded to the largest, as the stack holds them."""
    rng = np.random.default_rng(seed)
    R = max(ranks)
    A = np.zeros((len(ranks), R, Din), np.float32)
    B = np.zeros((len(ranks), Dout, R), np.float32)
    for i, r in enumerate(ranks):
        A[i, :r] = rng.standard_normal((r, Din)) / np.sqrt(Din)
        B[i, :, :r] = rng.standard_normal((Dout, r)) / np.sqrt(r)
    x = rng.standard_normal((T, Din)).astype(np.float32)
    y = rng.standard_normal((T, Dout)).astype(np.float32)
    scales = rng.uniform(0.5, 2.0, len(ranks)).astype(np.float32)
    return y, x, A, B, scales


IDX = {
    "segments": [0] * 20 + [1] * 3 + [-1] * 5 + [2] * 17,  # contiguous runs, one longer than a tile
    "interleaved": [2, -1, 0, 0, 1, 2, 2, -1, 1, 0, 0, 0, 2, 1, -1, -1, 0, 2, 1, 1, 1, 0, 2, 2, -1, 0, 1],
    "none": [-1] * 9,
}


# The kernel on CPU tensors runs under Triton's interpreter only (tests/conftest.py sets it without CUDA); on a CUDA
# machine test_gpu_kernel_matches_per_row_reference covers it.
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU-interpreter coverage; the GPU's is test_gpu_kernel_matches_per_row_reference")


@interpreter
@pytest.mark.parametrize("case", list(IDX))
@pytest.mark.parametrize("shape", [(48, 70), (130, 33)])  # Din, Dout: past one K block / not a block multiple
def test_sgmv_matches_per_row_reference(case, shape):
    idx = IDX[case]
    Din, Dout = shape
    y, x, A, B, scales = random_case(len(idx), Din, Dout, ranks=(4, 8, 3))
    want = per_row_reference(y, x, A, B, scales, idx)
    tiles = tiles_tensor(segment_tiles(idx), "cpu")
    t = {k: torch.from_numpy(v) for k, v in dict(y=y, x=x, A=A, B=B, s=scales).items()}
    got_kernel = lora_sgmv_fwd(t["y"].clone(), t["x"], t["A"], t["B"], t["s"], tiles).numpy()
    got_torch = torch_lora_sgmv(t["y"].clone(), t["x"], t["A"], t["B"], t["s"], tiles).numpy()
    assert_close(got_kernel, want, name="kernel")
    assert_close(got_torch, want, name="torch")
    untouched = [t for t, a in enumerate(idx) if a < 0]
    assert np.array_equal(got_kernel[untouched], y[untouched])  # rows without an adapter: not one bit changed


@interpreter
def test_empty_tiles_pad_a_fixed_grid():
    """Tiles with start == end change nothing: a captured step can launch a fixed number of tiles, padded."""
    idx = [0, 0, 1, -1, 1]
    y, x, A, B, scales = random_case(len(idx), 32, 20, ranks=(4, 2))
    tiles = segment_tiles(idx) + [(5, 5, 0), (0, 0, 1)]
    t = {k: torch.from_numpy(v) for k, v in dict(y=y, x=x, A=A, B=B, s=scales).items()}
    got = lora_sgmv_fwd(t["y"].clone(), t["x"], t["A"], t["B"], t["s"], tiles_tensor(tiles, "cpu")).numpy()
    assert_close(got, per_row_reference(y, x, A, B, scales, idx))


def test_segment_tiles():
    assert segment_tiles([0, 0, 0, -1, 1, 0], block_m=2) == [(0, 2, 0), (2, 3, 0), (4, 5, 1), (5, 6, 0)]
    assert segment_tiles([-1, -1]) == [] and segment_tiles([]) == []


def test_bf16_kernel_within_bf16_tolerance_of_fp32():
    idx = IDX["interleaved"]
    y, x, A, B, scales = random_case(len(idx), 64, 96, ranks=(8, 16, 4), seed=3)
    want = per_row_reference(y, x, A, B, scales, idx)
    b = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in dict(y=y, x=x, A=A, B=B).items()}
    with torch_only():  # the interpreter has no bf16 arithmetic: the torch version in bf16
        got = lora_sgmv_rows(b["y"].clone(), b["x"], b["A"], b["B"], torch.from_numpy(scales), idx)
    assert_close(got.float().numpy(), want, "bf16")


def test_one_adapter_equals_peft_lora_layer():
    """PEFT's lora.Linear over nn.Linear for rows with the adapter, the plain linear for the others; a second,
    larger-rank adapter in the stack pads the first one's rank."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    Din, Dout, r = 40, 24, 4
    base = torch.nn.Linear(Din, Dout, bias=False)
    model = torch.nn.Sequential()
    model.add_module("proj", base)
    cfg = peft.LoraConfig(r=r, lora_alpha=12, target_modules=["proj"], lora_dropout=0.0)
    lora = peft.get_peft_model(model, cfg).eval()
    layer = lora.base_model.model.proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0.0, 0.3)  # PEFT starts B at zero
    A1 = layer.lora_A["default"].weight.detach()  # [r, Din]
    B1 = layer.lora_B["default"].weight.detach()  # [Dout, r]
    A = torch.zeros(2, 8, Din)
    B = torch.zeros(2, Dout, 8)
    A[0] = torch.randn(8, Din)
    B[0] = torch.randn(Dout, 8)
    A[1, :r], B[1, :, :r] = A1, B1
    scales = torch.tensor([0.7, layer.scaling["default"]])
    x = torch.randn(21, Din)
    idx = [1, 1, -1, 0, 1, 1, 1, -1, 1, 0, 0] + [1] * 10
    with torch.no_grad():
        want_lora, want_base = layer(x), base(x)
        y = lora_sgmv_rows(base(x), x, A, B, scales, idx)
    on = [t for t, a in enumerate(idx) if a == 1]
    off = [t for t, a in enumerate(idx) if a == -1]
    assert_close(y[on].numpy(), want_lora[on].numpy())
    assert torch.equal(y[off], want_base[off])


def test_stacked_adapters_equal_merged_weights(tmp_path):
    """Each adapter's rows through the fused base GEMMs + the segmented product equal the same GEMMs over the
    refimpl's merged weights (per fused weight of every layer, q/k/v and gate/up in their fused row ranges)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from accel.lora_stack import stack_adapters
    from accel.weights import load_weights
    from refimpl.formats.checkpoint import load_checkpoint
    from refimpl.formats.lora import load_lora, merge_lora
    from tools.toy import TOYS, write_toy_checkpoint
    model_dir = write_toy_checkpoint(TOYS[0], tmp_path)
    ckpt = load_checkpoint(model_dir)
    cfg = ckpt.config
    adapters = {}
    kinds = {"attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
             "mlp": dict(r=6, lora_alpha=3, target_modules=["gate_proj", "up_proj", "down_proj", "v_proj"],
                         rank_pattern={"down_proj": 2}, use_rslora=True)}
    for seed, (name, kw) in enumerate(kinds.items()):
        base = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0, **kw))
        torch.manual_seed(seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.normal_(0.0, 0.3)
        model.save_pretrained(tmp_path / name)
        adapters[name] = load_lora(tmp_path / name, cfg)
    stack = stack_adapters(adapters, cfg, "cpu", torch.float32)
    w_base = load_weights(ckpt.params, cfg, torch.device("cpu"), torch.float32)
    merged = {n: load_weights(merge_lora(ckpt.params, cfg, a), cfg, torch.device("cpu"), torch.float32)
              for n, a in adapters.items()}
    idx = [0, 0, 1, -1, 1, 0, 1, 1, -1, 0]
    rng = np.random.default_rng(5)
    for layer in range(cfg.num_hidden_layers):
        for weight in ("qkv", "o", "gate_up", "down"):
            W = getattr(w_base.layers[layer], weight)  # [Dout, Din]
            x = torch.from_numpy(rng.standard_normal((len(idx), W.shape[1])).astype(np.float32))
            y = stack.add(layer, weight, x @ W.T, x, tiles_tensor(segment_tiles(idx), "cpu"))
            for t, a in enumerate(idx):
                W_t = W if a < 0 else getattr(merged[stack.names[a]].layers[layer], weight)
                assert_close(y[t].numpy(), (x[t] @ W_t.T).numpy(), name=f"layer {layer} {weight} row {t}")
    assert stack.index("mlp") == 1 and stack.index(None) == -1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_kernel_matches_per_row_reference(dtype):
    """The compiled kernel on the GPU: fp32 (IEEE products) and bf16, against float64 NumPy, and the torch version
    on the same device within the same tolerance."""
    idx = IDX["interleaved"] * 5  # 135 rows, many tiles
    y, x, A, B, scales = random_case(len(idx), 2048, 3072, ranks=(16, 64, 8), seed=7)
    want = per_row_reference(y, x, A, B, scales, idx)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    t = {k: torch.from_numpy(v).to("cuda", dt) for k, v in dict(y=y, x=x, A=A, B=B).items()}
    s = torch.from_numpy(scales).cuda()
    got = lora_sgmv_rows(t["y"].clone(), t["x"], t["A"], t["B"], s, idx)
    with torch_only():
        got_torch = lora_sgmv_rows(t["y"].clone(), t["x"], t["A"], t["B"], s, idx)
    assert_close(got.float().cpu().numpy(), want, dtype, "kernel")
    assert_close(got_torch.float().cpu().numpy(), want, dtype, "torch")
