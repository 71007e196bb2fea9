"""Swap a loaded HF Llama / Llama 3.2 Vision model's RMSNorm and SwiGLU MLP forwards for llama32's Triton forward +
backward (accel/train/fused.py), as Liger-Kernel's apply_liger_kernel_to_llama does: one flag per kernel, one table
by model_type. The modules stay where they are (their weights, PEFT's LoRA wrappers on the MLP's linears, hooks):
only their forward changes, per instance.

Each patched forward runs HF's own forward where the kernel does not apply, so a patched model never computes
something else:
  * RMSNorm: the kernel gives no weight gradient (norms are frozen under LoRA): a norm whose weight requires a
    gradient (full fine-tuning) runs HF's forward while gradients are recorded; so does a weight of another dtype
    than the activations (HF's product would then promote).
  * MLP: only silu gating; gate and up outputs of one dtype.
  * Both: only where the Triton kernels run (CUDA tensors, or the interpreter: TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os
import types

import torch

from accel.train import fused

# model_type -> {kernel flag: class names of the modules whose forward it replaces}
PATCHES = {
    "llama": {"rms_norm": ("LlamaRMSNorm",), "swiglu": ("LlamaMLP",)},
    "mllama": {"rms_norm": ("MllamaTextRMSNorm",), "swiglu": ("MllamaTextMLP",)},
    "mllama_text_model": {"rms_norm": ("MllamaTextRMSNorm",), "swiglu": ("MllamaTextMLP",)},
}
SILU = ("silu", "swish")


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
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.dtype != up.dtype:
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj(fused.swiglu_pair(gate, up))


FORWARDS = {"rms_norm": rms_norm_forward, "swiglu": swiglu_mlp_forward}


def apply(model: torch.nn.Module, rms_norm: bool = True, swiglu: bool = True) -> dict[str, int]:
    """Patch `model` (a transformers model, or a PEFT model around one) in place -> {flag: modules patched now}.
    Idempotent: modules patched before are not counted again. Raises ValueError for a model_type not in PATCHES."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in PATCHES:
        raise ValueError(f"accel.hf.apply: model_type {model_type!r} is not one of {sorted(PATCHES)}")
    wanted = {flag: PATCHES[model_type][flag] for flag, on in (("rms_norm", rms_norm), ("swiglu", swiglu)) if on}
    counts = dict.fromkeys(wanted, 0)
    for module in model.modules():
        for flag, class_names in wanted.items():
            if type(module).__name__ in class_names and not getattr(module, "llama32_patched", False):
                module.forward = types.MethodType(FORWARDS[flag], module)
                module.llama32_patched = True
                counts[flag] += 1
    return counts


def revert(model: torch.nn.Module) -> int:
    """Undo apply(): every patched module runs its class's forward again -> how many were patched."""
    n = 0
    for module in model.modules():
        if getattr(module, "llama32_patched", False):
            del module.forward, module.llama32_patched
            n += 1
    return n
