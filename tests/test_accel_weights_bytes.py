"""accel.weights.Weights.nbytes of a quantized model as the accel engine loads it (quantized at load by a spec, or
from refimpl's quantized records; every layer packed for the prefill) against the bytes of what it holds, counted
here from the formats' definitions: int8 a code a weight and a bf16 scale a row; int4:G half a byte a weight and a
bf16 scale and minimum a G-column group; the embedding and norms dense in the engine's dtype; and each packed
layer's dequantize tables (accel.quant_layers.LayerPlan), int64 rows."""
import math

import pytest

torch = pytest.importorskip("torch")

from accel.engine import AccelEngine  # noqa: E402
from refimpl.formats.params import Checkpoint, random_params  # noqa: E402
from refimpl.quant.apply import quantize_params  # noqa: E402
from refimpl.quant.schemes import QuantSpec  # noqa: E402
from test_gguf import tiny_config  # noqa: E402


def matrix_bytes(spec: QuantSpec, N: int, K: int) -> int:
    """An [N, K] matrix in one format."""
    if spec.format == "int8":
        return N * K + 2 * N
    return N * math.ceil(K / 2) + 2 * 2 * N * math.ceil(K / spec.group)


def held_bytes(cfg, spec: QuantSpec, weights, itemsize: int) -> int:
    D, F, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    n = V * D * itemsize + (2 * L + 1) * D * itemsize  # the embedding, two norms a layer and the final norm
    for i, layer in enumerate(weights.layers):
        fmt = lambda key: spec.for_matrix(f"model.layers.{i}.{key}.weight")  # noqa: E731
        n += matrix_bytes(fmt("self_attn.q_proj"), cfg.q_size + 2 * cfg.kv_size, D)  # q, k, v: one format
        n += matrix_bytes(fmt("self_attn.o_proj"), D, cfg.q_size)
        n += matrix_bytes(fmt("mlp.gate_proj"), 2 * F, D)
        n += matrix_bytes(fmt("mlp.down_proj"), D, F)
        n += sum(launch.table.numel() * 8 for launch in layer.plan.launches)
    return n + matrix_bytes(spec.for_matrix("lm_head.weight"), V, D)


@pytest.mark.parametrize("spec", ["int8", "int4:64", "int4:64:mixed"])
@pytest.mark.parametrize("at_load", [True, False], ids=["quantized at load", "quantized records"])
def test_weights_nbytes_of_a_packed_quantized_model(tmp_path, spec, at_load):
    cfg = tiny_config(tied=False)
    spec = QuantSpec.parse(spec)
    params = random_params(cfg, seed=4, std=0.1)
    if at_load:
        engine = AccelEngine.from_checkpoint(Checkpoint(tmp_path, cfg, params), device="cpu", dtype="fp32",
                                             quant=spec)
    else:
        ckpt = Checkpoint(tmp_path, cfg, quantize_params(params, cfg, spec))
        engine = AccelEngine.from_checkpoint(ckpt, device="cpu", dtype="fp32")
    w = engine.weights
    assert all(layer.plan is not None for layer in w.layers)  # packed: what the bench's weights_gb reads
    assert len(w.layers[0].plan.launches) == (2 if spec.int8_keys else 1)  # one dequantize launch a format
    assert w.nbytes() == held_bytes(cfg, spec, w, 4)
