"""Swap a loaded HF Llama / Llama 3.2 Vision model's RMSNorm, SwiGLU MLP and RoPE for llama32's Triton forward +
backward (accel/train/fused.py), as Liger-Kernel's apply_liger_kernel_to_llama does: one flag per kernel, one table
by model_type. The modules stay where they are (their weights, PEFT's LoRA wrappers on the MLP's linears, hooks):
only their forward changes, per instance. RoPE is no module: the attention calls its modeling file's
`apply_rotary_pos_emb`, so that function is replaced in the modeling file, for every model of that type in the
process (it gives the same answers; revert() puts the original back).

Each patched forward runs HF's own forward where the kernel does not apply, so a patched model never computes
something else:
  * RMSNorm: the kernel gives no weight gradient (norms are frozen under LoRA): a norm whose weight requires a
    gradient (full fine-tuning) runs HF's forward while gradients are recorded; so does a weight of another dtype
    than the activations (HF's product would then promote).
  * MLP: only silu gating; gate and up outputs of one dtype.
  * RoPE: only HF's half-split layout with cos/sin [B or 1, T, E] whose halves repeat (every Llama RoPE type).
  * lm_head + cross-entropy (off by default): only a training forward with labels, a frozen bias-free nn.Linear
    lm_head, all logits (logits_to_keep 0); the output then carries the loss and no logits (as Liger's).
  * LoRA (off by default, PEFT models): accel/hf/lora.py's conditions (one active plain adapter, no dropout, a
    frozen nn.Linear base); the MLP and (under "llama32", without a cache) the self-attention's q, k, v + RoPE as
    one Function only where all their linears are plain frozen ones or patched LoRA ones.
  * Frozen vision tower (Llama 3.2 Vision): its forward runs under torch.no_grad() only where no parameter of it
    trains and no input needs a gradient, so no parameter's gradient changes; its encoders, where autograd is off,
    keep only the layer outputs the vision model reads (None at the others).
  * Offloaded checkpoints (off by default): the decoder layers whose gradient checkpointing is on keep their
    inputs in pinned host memory until their backward (accel/hf/offload.py); on CPU a clone.
  * All (but the frozen vision tower and the offloaded checkpoints): only where the Triton kernels run (CUDA
    tensors, or the interpreter: TRITON_INTERPRET=1).
"""
from __future__ import annotations

import importlib
import inspect
import os
import types

import torch

from accel.hf.attention import attention_forward
from accel.hf.lora import lora_linear_forward, projection
from accel.hf.memo import PerTensor
from accel.hf import offload
from accel.hf.mlp import lora_swiglu_mlp
from accel.hf.qkv import lora_qkv_rope
from accel.train import fused
from accel.train.loss import linear_cross_entropy

# model_type -> {kernel flag: class names of the modules whose forward it replaces; "rope": the modeling file;
# "vision_states": the frozen vision model's encoders (attribute) -> its attribute listing the encoder's layer outputs
# that it reads (None: only the last)}
PATCHES = {
    "llama": {"rms_norm": ("LlamaRMSNorm",), "swiglu": ("LlamaMLP",), "attention": ("LlamaAttention",),
              "fused_linear_cross_entropy": ("LlamaForCausalLM",), "offload_checkpoints": ("LlamaDecoderLayer",),
              "rope": "transformers.models.llama.modeling_llama"},
    "mllama": {"rms_norm": ("MllamaTextRMSNorm",), "swiglu": ("MllamaTextMLP",),
               "attention": ("MllamaTextSelfAttention",), "frozen_vision": ("MllamaVisionModel",),
               "vision_states": {"transformer": "intermediate_layers_indices", "global_transformer": None},
               "fused_linear_cross_entropy": ("MllamaForConditionalGeneration",),
               "offload_checkpoints": ("MllamaSelfAttentionDecoderLayer", "MllamaCrossAttentionDecoderLayer"),
               "rope": "transformers.models.mllama.modeling_mllama"},
    "mllama_text_model": {"rms_norm": ("MllamaTextRMSNorm",), "swiglu": ("MllamaTextMLP",),
                          "attention": ("MllamaTextSelfAttention",),
                          "fused_linear_cross_entropy": ("MllamaForCausalLM",),
                          "offload_checkpoints": ("MllamaSelfAttentionDecoderLayer",
                                                  "MllamaCrossAttentionDecoderLayer"),
                          "rope": "transformers.models.mllama.modeling_mllama"},
}
SILU = ("silu", "swish")
# rows of [rows, V] logits alive at once in the fused loss: an HF + PEFT LoRA step's peak memory is there, so fewer
# than accel.train.loss's default (256 rows: 63 MB at V = 128256 in bf16; docs/performance.md has the runs)
LOSS_CHUNK_ROWS = 256


def patched(module: torch.nn.Module) -> bool:
    """Whether apply() replaced this module's forward. Its own attribute only: PEFT's wrappers (PeftModel,
    LoraModel) hand unknown attribute lookups on to the model they wrap."""
    return vars(module).get("llama32_patched", False)


def kernels_run_on(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if ((w.requires_grad and torch.is_grad_enabled()) or w.dtype != hidden_states.dtype
            or not kernels_run_on(hidden_states)):
        return type(self).forward(self, hidden_states)
    return fused.rms_norm(hidden_states, w, self.variance_epsilon)


def swiglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    if self.config.hidden_act not in SILU or not kernels_run_on(x):
        return type(self).forward(self, x)
    projs = lora_projections(self, x)
    if projs is not None:
        return lora_swiglu_mlp(x, *projs)
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.dtype != up.dtype:
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj(fused.swiglu_pair(gate, up))


def adapted_projections(mods, x: torch.Tensor):
    """accel.hf.lora.projection tuples of `mods` where all are plain frozen linears or LoRA linears patched by
    apply(lora=True), at least one of them LoRA (their consumer then runs them in one Function); None otherwise."""
    if not any(patched(m) and hasattr(m, "lora_A") for m in mods):
        return None
    projs = tuple(projection(m, x) for m in mods)
    if any(p is None or (p[2] is not None and not patched(m)) for p, m in zip(projs, mods)):
        return None
    return projs


def lora_projections(mlp, x: torch.Tensor):
    """The MLP's (gate, up, down) as adapted_projections: the MLP then runs as one Function (accel/hf/mlp.py)."""
    return adapted_projections((mlp.gate_proj, mlp.up_proj, mlp.down_proj), x)


_rope_tables = PerTensor()  # (cos, sin) -> the kernel's tables: the model passes one pair to every layer


def halves(cos: torch.Tensor, sin: torch.Tensor):
    """HF's cos/sin [B or 1, T, E] (the halves repeat) -> the kernel's [B or 1, T, E/2] fp32 tables."""
    half = cos.shape[-1] // 2
    return cos[..., :half].float(), sin[..., :half].float()


def rope_function(original):
    """HF's apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1) over the Triton RoPE, `original` where it does
    not apply. q [B, H, T, E], k [B, K, T, E], cos/sin [B or 1, T, E] (the halves repeat)."""
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        B, _, T, E = q.shape
        if (args or kwargs.get("unsqueeze_dim", 1) != 1 or set(kwargs) - {"unsqueeze_dim"} or cos.dim() != 3
                or cos.shape[1:] != (T, E) or k.shape[2] != T or k.dtype != q.dtype or not kernels_run_on(q)):
            return original(q, k, cos, sin, *args, **kwargs)
        c, s = _rope_tables.get((cos, sin), None, lambda: halves(cos, sin))  # [B or 1, T, E/2] fp32
        qr, kr = fused.rope_qk(q.transpose(1, 2), k.transpose(1, 2), c.expand(B, T, -1), s.expand(B, T, -1))
        return qr.transpose(1, 2), kr.transpose(1, 2)
    apply_rotary_pos_emb.llama32_original = original
    return apply_rotary_pos_emb


def qkv_attention_forward(self, hidden_states: torch.Tensor, *args, **kwargs):
    """HF's self-attention forward (training: no cache) with q, k, v and RoPE as one Function (accel/hf/qkv.py),
    then the "llama32" attention and o_proj; HF's own forward where qkv_plan says it does not apply."""
    plan = None if args else qkv_plan(self, hidden_states, kwargs)
    if plan is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    q, k, v = lora_qkv_rope(hidden_states, *plan)
    rest = {n: x for n, x in kwargs.items() if n not in ("position_embeddings", "attention_mask", "cache",
                                                         "past_key_values", "past_key_value")}
    out, weights = attention_forward(self, q, k, v, kwargs.get("attention_mask"), dropout=0.0,
                                     scaling=self.scaling, **rest)
    out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()  # [B, T, H, E] -> [B, T, H·E]
    return self.o_proj(out), weights


def qkv_plan(attn, x: torch.Tensor, kwargs: dict):
    """(cos rows, sin rows, (H, K), q, k, v projections) for lora_qkv_rope, or None where HF's forward must run: a
    cache, another attention implementation than "llama32", attention dropout while training, RoPE tables not of
    HF's layout, q / k / v not all plain frozen linears or LoRA linears patched by apply(lora=True)."""
    pe = kwargs.get("position_embeddings")
    if (pe is None or x.dim() != 3 or attn.config._attn_implementation != "llama32" or not kernels_run_on(x)
            or any(kwargs.get(n) is not None for n in ("cache", "past_key_values", "past_key_value"))
            or (attn.training and getattr(attn, "attention_dropout", getattr(attn, "dropout", 0.0)) > 0)):
        return None
    cos, sin = pe
    B, T, _ = x.shape
    E = attn.head_dim
    if cos.dim() != 3 or cos.shape[0] not in (1, B) or cos.shape[1:] != (T, E) or sin.shape != cos.shape:
        return None
    projs = adapted_projections((attn.q_proj, attn.k_proj, attn.v_proj), x)
    if projs is None:
        return None
    heads = (projs[0][0].shape[0] // E, projs[1][0].shape[0] // E)
    rows = _rope_rows.get((cos, sin), B, lambda: tuple(t.expand(B, T, -1).reshape(B * T, -1)
                                                       for t in halves(cos, sin)))  # [B·T, E/2] fp32 each
    return (*rows, heads, *projs)


_rope_rows = PerTensor()  # (cos, sin) -> [B·T, E/2] rows: the model passes one pair to every layer


def patch_rope(module_name: str) -> int:
    """Replace the modeling file's apply_rotary_pos_emb -> 1, or 0 where it already was."""
    modeling = importlib.import_module(module_name)
    if hasattr(modeling.apply_rotary_pos_emb, "llama32_original"):
        return 0
    modeling.apply_rotary_pos_emb = rope_function(modeling.apply_rotary_pos_emb)
    return 1


def unpatch_rope(module_name: str) -> int:
    modeling = importlib.import_module(module_name)
    original = getattr(modeling.apply_rotary_pos_emb, "llama32_original", None)
    if original is None:
        return 0
    modeling.apply_rotary_pos_emb = original
    return 1


def frozen_vision_forward(self, *args, **kwargs):
    """HF's vision model forward, under torch.no_grad() where nothing in it trains and no input tensor needs a
    gradient. transformers' enable_input_require_grads (which PEFT calls for gradient checkpointing) makes the patch
    embedding's output require a gradient, so the frozen tower would otherwise keep every layer's activations
    (it is not checkpointed) and run its whole backward for a gradient nothing reads."""
    if torch.is_grad_enabled() and not any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (*args, *kwargs.values())):
        if not any(p.requires_grad for p in self.parameters()):
            with torch.no_grad():
                return type(self).forward(self, *args, **kwargs)
    return type(self).forward(self, *args, **kwargs)


def vision_encoder_forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """HF's vision encoder forward; where autograd is off, it keeps only the layer outputs its vision model reads
    (`llama32_keep`; None at the other indices, the tuple as long as HF's). HF's keeps every layer's output until
    the vision model returns (11B-Vision: 32 + 8 of [4 tiles · 1608, 1280], 0.61 GiB), for 5 that it reads."""
    if torch.is_grad_enabled():
        return type(self).forward(self, hidden_states, attention_mask)
    from transformers.modeling_outputs import BaseModelOutput
    states = []
    for i, layer in enumerate(self.layers):
        hidden_states = layer(hidden_states=hidden_states, attention_mask=attention_mask)
        states.append(hidden_states if i in self.llama32_keep else None)
    return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=tuple(states))


def keep_read_states(vision: torch.nn.Module, readers: dict) -> None:
    """Patch the vision model's encoders (`readers`: attribute -> the vision model's attribute listing the layer
    outputs it reads, None: none) with vision_encoder_forward, where their forward is HF's (hidden_states,
    attention_mask) one."""
    for name, indices in readers.items():
        encoder = getattr(vision, name, None)
        if (encoder is None or patched(encoder) or list(inspect.signature(type(encoder).forward).parameters)
                != ["self", "hidden_states", "attention_mask"]):
            continue
        n = len(encoder.layers)
        encoder.llama32_keep = frozenset(i % n for i in (getattr(vision, indices) if indices else ()))
        encoder.forward = types.MethodType(vision_encoder_forward, encoder)
        encoder.llama32_patched = True


def fused_loss_forward(self, *args, labels=None, **kwargs):
    """The causal LM's forward with the lm_head and HF's causal-LM loss (labels shifted left, mean over the label
    tokens or sum / num_items_in_batch) fused: the [T, V] logits never exist at once."""
    head = self.lm_head
    if (args or labels is None or not torch.is_grad_enabled() or type(head) is not torch.nn.Linear
            or head.bias is not None or head.weight.requires_grad or kwargs.get("logits_to_keep", 0) != 0
            or kwargs.get("return_dict") is False or not kernels_run_on(head.weight)):
        return type(self).forward(self, *args, labels=labels, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast
    kwargs.pop("return_dict", None)
    shift = kwargs.pop("shift_labels", None)
    n_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("logits_to_keep", None)
    out = self.model(**kwargs)
    h = out.last_hidden_state  # [B, T, D]
    if shift is None:  # token t predicts token t + 1
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    shift = shift.reshape(-1).to(h.device)
    total = linear_cross_entropy(h.reshape(-1, h.shape[-1]), head.weight, shift, chunk=LOSS_CHUNK_ROWS,
                                 use_triton=True)
    loss = total / (n_items if n_items is not None else (shift != -100).sum())
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(out, "hidden_states", None),
                                  attentions=getattr(out, "attentions", None))


FORWARDS = {"rms_norm": rms_norm_forward, "swiglu": swiglu_mlp_forward,
            "fused_linear_cross_entropy": fused_loss_forward, "lora": lora_linear_forward,
            "attention": qkv_attention_forward, "frozen_vision": frozen_vision_forward}


def model_type_of(model: torch.nn.Module) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in PATCHES:
        raise ValueError(f"accel.hf: model_type {model_type!r} is not one of {sorted(PATCHES)}")
    return model_type


def apply(model: torch.nn.Module, rms_norm: bool = True, swiglu: bool = True, rope: bool = True,
          fused_linear_cross_entropy: bool = False, lora: bool = False, frozen_vision: bool = True,
          offload_checkpoints: bool = False) -> dict[str, int]:
    """Patch `model` (a transformers model, or a PEFT model around one) in place -> {flag: modules patched now}
    ("rope": 1 where its modeling file's function was replaced now). `lora`: PEFT's LoRA linears as one autograd
    Function each, their branch in the activations' dtype (accel/hf/lora.py); with `swiglu` each MLP as one
    (accel/hf/mlp.py), with `rope` each self-attention's q, k, v and RoPE as one (accel/hf/qkv.py; "attention":
    under attn_implementation "llama32"). `frozen_vision` (Llama 3.2 Vision): the vision tower runs without
    autograd where nothing in it trains ("frozen_vision": 1), its encoders keeping only the layer outputs it reads.
    `offload_checkpoints`: the decoder layers whose gradient checkpointing is on (enable it first) keep their inputs
    in pinned host memory until their backward (accel/hf/offload.py; "offload_checkpoints": layers changed).
    Idempotent: what was patched before is not counted again. Raises ValueError for a model_type not in PATCHES."""
    table = PATCHES[model_type_of(model)]
    flags = (("rms_norm", rms_norm), ("swiglu", swiglu), ("fused_linear_cross_entropy", fused_linear_cross_entropy),
             ("attention", lora and rope), ("frozen_vision", frozen_vision))
    wanted = {flag: table[flag] for flag, on in flags if on and flag in table}
    counts = dict.fromkeys(wanted, 0)
    if rope:
        counts["rope"] = patch_rope(table["rope"])
    lora_class = _peft_lora_linear() if lora else None
    if lora:
        counts["lora"] = 0
    layers = table["offload_checkpoints"] if offload_checkpoints else ()
    if offload_checkpoints:
        counts["offload_checkpoints"] = 0
    for module in model.modules():
        if type(module).__name__ in layers:
            counts["offload_checkpoints"] += offload.install(module)
        if patched(module):
            continue
        flag = next((f for f, names in wanted.items() if type(module).__name__ in names), None)
        if flag is None and lora_class is not None and type(module) is lora_class:
            flag = "lora"
        if flag is not None:
            module.forward = types.MethodType(FORWARDS[flag], module)
            module.llama32_patched = True
            counts[flag] += 1
            if flag == "frozen_vision":  # its encoders with it (not counted)
                keep_read_states(module, table.get("vision_states", {}))
    return counts


def _peft_lora_linear():
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


def revert(model: torch.nn.Module) -> int:
    """Undo apply(): every patched module runs its class's forward again, every offloaded layer HF's checkpoint
    function, the modeling file's RoPE is HF's again (for every model of that type) -> how many modules (and RoPE
    functions) were patched."""
    n = unpatch_rope(PATCHES[model_type_of(model)]["rope"])
    for module in model.modules():
        n += offload.uninstall(module)
        if patched(module):
            del module.forward, module.llama32_patched
            vars(module).pop("llama32_keep", None)
            n += 1
    return n
