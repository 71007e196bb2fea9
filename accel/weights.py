"""Weights on the device, rearranged once at load time for the fast path.

The fast forward multiplies by two fused matrices per layer instead of five separate ones:
    qkv      [(H + 2K)·E, D]  rows: q_proj, then k_proj, then v_proj     (one GEMM instead of three)
    gate_up  [2F, D]          rows: gate_proj, then up_proj              (one GEMM instead of two)
At batch 1 each GEMM is a short weight-bandwidth-bound matrix-vector product, so three launches for q/k/v
cost ~2 launch-latencies more than one (gpt-fast fuses wq/wk/wv at load for the same reason).

Trace mode (`refimpl.model.llama.forward_steps` over `accel.ops`) wants the checkpoint's own names; `params_view` gives
them as `narrow` views of the fused tensors, never copies. With tied embeddings the lm_head *is* the embedding
tensor. Tensors are loaded one at a time (host float32 -> device dtype) so the host holds at most one extra copy.
A quantized run (a QuantSpec, or a checkpoint of refimpl QuantizedLinear records) loads the linear layers as
accel.quant_ops.QuantTensors, each layer packed for the prefill (accel.quant_layers).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from refimpl.model.config import LlamaConfig
from refimpl.quant.apply import is_quantized
from refimpl.quant.schemes import QuantizedLinear, QuantSpec

from .quant_layers import LayerPlan, pack_layer
from .quant_ops import cat_rows, from_quantized_linear, quantize

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [D]
    qkv: torch.Tensor  # [(H+2K)·E, D]
    o: torch.Tensor  # [D, H·E]
    mlp_norm: torch.Tensor  # [D]
    gate_up: torch.Tensor  # [2F, D]
    down: torch.Tensor  # [D, F]
    plan: LayerPlan | None = None  # quantized: how the prefill dequantizes the layer (accel.quant_layers.pack_layer)


@dataclass
class Weights:
    embed: torch.Tensor  # [V, D]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [D]
    lm_head: torch.Tensor  # [V, D]; the same tensor object as `embed` when tied

    def nbytes_per_token(self) -> int:
        """Bytes of weights a batch-1 decode step reads: every matrix once, one embedding row, the lm_head.

        A tied embedding is counted once (as the lm_head); its one gathered row is negligible (D elements).
        """
        tensors = [self.norm, self.lm_head]
        for w in self.layers:
            tensors += [w.attn_norm, w.qkv, w.o, w.mlp_norm, w.gate_up, w.down]
        n = sum(t.nbytes for t in tensors)  # .nbytes: a torch tensor's, or a quantized matrix's (accel.quant_ops)
        if self.lm_head is not self.embed:
            n += self.embed.shape[1] * self.embed.element_size()
        return n

    def nbytes(self) -> int:
        seen, n = set(), 0
        for t in [self.embed, self.norm, self.lm_head] + [x for w in self.layers for x in vars(w).values()]:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                n += t.nbytes
        return n


def host_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a host array. Checkpoint arrays may be read-only (memory-mapped safetensors); torch warns
    about that, but these views are only ever read (copied to the device), so the warning is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(array))


def to_device(array: np.ndarray, device, dtype) -> torch.Tensor:
    return host_tensor(array).to(device=device, dtype=dtype)


def _fill_rows(dst: torch.Tensor, parts: list[np.ndarray]) -> torch.Tensor:
    """Copy host arrays into consecutive row blocks of a preallocated device tensor, one part at a time."""
    row = 0
    for a in parts:
        dst.narrow(0, row, a.shape[0]).copy_(host_tensor(a))
        row += a.shape[0]
    return dst


def load_weights(params: dict[str, np.ndarray], cfg: LlamaConfig, device, dtype: torch.dtype,
                 quant=None) -> Weights:
    """float32 NumPy params keyed by HF names -> fused device tensors in `dtype`.

    quant (a refimpl.quant.schemes.QuantSpec), or params holding refimpl QuantizedLinear records: the linear
    layers become accel.quant_ops.QuantTensors instead (`load_quantized_weights`)."""
    if quant is not None or is_quantized(params):
        return load_quantized_weights(params, cfg, device, dtype, quant)
    D, F = cfg.hidden_size, cfg.intermediate_size
    qkv_rows = cfg.q_size + 2 * cfg.kv_size
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = torch.empty(qkv_rows, D, device=device, dtype=dtype)  # [(H+2K)·E, D]
        _fill_rows(qkv, [params[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        gate_up = torch.empty(2 * F, D, device=device, dtype=dtype)  # [2F, D]
        _fill_rows(gate_up, [params[p + "mlp.gate_proj.weight"], params[p + "mlp.up_proj.weight"]])
        layers.append(LayerWeights(
            attn_norm=to_device(params[p + "input_layernorm.weight"], device, dtype),
            qkv=qkv, o=to_device(params[p + "self_attn.o_proj.weight"], device, dtype),
            mlp_norm=to_device(params[p + "post_attention_layernorm.weight"], device, dtype),
            gate_up=gate_up, down=to_device(params[p + "mlp.down_proj.weight"], device, dtype)))
    embed = to_device(params["model.embed_tokens.weight"], device, dtype)
    lm_head = embed if cfg.tie_word_embeddings else to_device(params["lm_head.weight"], device, dtype)
    return Weights(embed, layers, to_device(params["model.norm.weight"], device, dtype), lm_head)


def _matrix(parts: list, device, spec: QuantSpec | None, dtype: torch.dtype):
    """Host matrices stacked by rows -> a QuantTensor (refimpl records converted, fp32 arrays quantized by
    `spec`), or a dense device tensor in `dtype` (no spec, or GGUF parts of mixed or unsupported types)."""
    if all(isinstance(p, QuantizedLinear) for p in parts) and len({p.format for p in parts}) == 1:
        return cat_rows([from_quantized_linear(p, device) for p in parts])
    dense = torch.cat([host_tensor(p.dequantize() if isinstance(p, QuantizedLinear) else p).to(device)
                       for p in parts])
    if spec is None or spec.format == "gguf":
        return dense.to(dtype)
    return quantize(dense, spec)


def load_quantized_weights(params: dict, cfg: LlamaConfig, device, dtype: torch.dtype, spec: QuantSpec | None):
    """load_weights for a quantized run: the linear layers (and the lm_head unless spec.lm_head is False) as
    QuantTensors, each layer packed for the prefill (accel.quant_layers.pack_layer), the embedding and norms dense
    in `dtype`."""
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        one = (lambda key: None if spec is None else spec.for_matrix(p + key))  # noqa: E731  a fused group's format
        layers.append(pack_layer(LayerWeights(
            attn_norm=to_device(params[p + "input_layernorm.weight"], device, dtype),
            qkv=_matrix([params[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], device, one("self_attn.q_proj"),
                        dtype),
            o=_matrix([params[p + "self_attn.o_proj.weight"]], device, one("self_attn.o_proj"), dtype),
            mlp_norm=to_device(params[p + "post_attention_layernorm.weight"], device, dtype),
            gate_up=_matrix([params[p + "mlp.gate_proj.weight"], params[p + "mlp.up_proj.weight"]], device,
                            one("mlp.gate_proj"), dtype),
            down=_matrix([params[p + "mlp.down_proj.weight"]], device, one("mlp.down_proj"), dtype))))
    embed = to_device(params["model.embed_tokens.weight"], device, dtype)
    head = params.get("lm_head.weight")
    if isinstance(head, QuantizedLinear) or (spec is not None and spec.format != "gguf" and spec.lm_head):
        lm_head = _matrix([head if head is not None else params["model.embed_tokens.weight"]], device,
                          spec and spec.for_matrix("lm_head.weight"), dtype)
    else:
        lm_head = embed if head is None else to_device(head, device, dtype)
    return Weights(embed, layers, to_device(params["model.norm.weight"], device, dtype), lm_head)


def random_weights(cfg: LlamaConfig, device, dtype: torch.dtype, seed: int = 0, std: float = 0.02) -> Weights:
    """Random weights built directly on the device (no NumPy round trip): for the benchmark at real shapes.

    Norm weights are 1 + N(0, 0.1²) and matrices N(0, std²), as refimpl.formats.params.random_params draws them.
    """
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size

    def mat(rows, cols):
        return (torch.randn(rows, cols, device=device, dtype=torch.float32, generator=g) * std).to(dtype)

    def norm():
        return (1 + 0.1 * torch.randn(D, device=device, dtype=torch.float32, generator=g)).to(dtype)

    layers = [LayerWeights(norm(), mat(cfg.q_size + 2 * cfg.kv_size, D), mat(D, cfg.q_size), norm(),
                           mat(2 * F, D), mat(D, F)) for _ in range(cfg.num_hidden_layers)]
    embed = mat(V, D)
    lm_head = embed if cfg.tie_word_embeddings else mat(V, D)
    return Weights(embed, layers, norm(), lm_head)


def params_view(w: Weights, cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """HF-named views of the fused tensors (narrow, no copies) for refimpl.model.llama.forward_steps."""
    q, kv, F = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    out = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.norm}
    if w.lm_head is not w.embed:  # untied, or a tied lm_head quantized apart from the embedding (accel.quant_ops)
        out["lm_head.weight"] = w.lm_head
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": lw.attn_norm,
            p + "self_attn.q_proj.weight": lw.qkv.narrow(0, 0, q),
            p + "self_attn.k_proj.weight": lw.qkv.narrow(0, q, kv),
            p + "self_attn.v_proj.weight": lw.qkv.narrow(0, q + kv, kv),
            p + "self_attn.o_proj.weight": lw.o,
            p + "post_attention_layernorm.weight": lw.mlp_norm,
            p + "mlp.gate_proj.weight": lw.gate_up.narrow(0, 0, F),
            p + "mlp.up_proj.weight": lw.gate_up.narrow(0, F, F),
            p + "mlp.down_proj.weight": lw.down,
        })
    return out
