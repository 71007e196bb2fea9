"""HF transformers on the same weights: the baselines the benchmarks measure beside ours."""
from __future__ import annotations

import json
import time

from refimpl.model.config import LlamaConfig

from .cli import model_config
from .runs import sync

HF_MEMORY = 0.6  # of the free GPU memory, HF's KV cache in its continuous batching (with its CUDA graphs)

def hf_bf16_model(build, device, param_of):
    """build()'s HF model, made on the device in bf16 (the default dtype during the build), in eval mode, each
    parameter a copy of param_of(its name)."""
    import torch
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = build().eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(param_of(name))
    return model


def hf_llama(cfg: LlamaConfig, weights, device):
    """transformers' LlamaForCausalLM built on the device in bf16, holding copies of accel Weights' tensors."""
    import transformers

    from accel.weights import params_view
    views = params_view(weights, cfg)
    if cfg.tie_word_embeddings:
        views.setdefault("lm_head.weight", weights.lm_head)
    return hf_bf16_model(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf())), device,
                         views.__getitem__)


# ---- models at the Llama 3.2 shapes, random weights (tools/bench/hf_attention.py) ----

HF_ROPE_32 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
HF_VISION_11B = dict(
    text_config=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=40, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                     cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38],
                     rope_parameters=dict(HF_ROPE_32, factor=8.0)),
    vision_config=dict(image_size=560, patch_size=14, max_num_tiles=4, hidden_size=1280, intermediate_size=5120,
                       num_hidden_layers=32, num_global_layers=8, attention_heads=16, vision_output_dim=7680,
                       intermediate_layers_indices=[3, 7, 15, 23, 30]),
)


def hf_random_model(name: str, layers: int | None = None, device: str = "cuda"):
    """transformers' model of `name`'s shape ("1b", "3b", "11b-vision"; `layers`: cut to that many decoder layers,
    11B-Vision keeping a cross-attention layer among them), random bf16 weights on `device` (every Mllama gate
    nonzero, so the image matters)."""
    import torch
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM, MllamaConfig, MllamaForConditionalGeneration
    if name == "11b-vision":
        spec = json.loads(json.dumps(HF_VISION_11B))
        if layers:  # keep the first cross-attention layer among the first `layers`
            spec["text_config"]["num_hidden_layers"] = layers
            spec["text_config"]["cross_attention_layers"] = [min(3, layers - 1)]
        config, cls = MllamaConfig(**spec), MllamaForConditionalGeneration
    else:
        spec = {k: v for k, v in model_config(name).to_hf().items() if k not in ("architectures", "model_type")}
        if layers:
            spec["num_hidden_layers"] = layers
        config, cls = HFLlamaConfig(**spec), LlamaForCausalLM
    with torch.device(device):
        model = cls._from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "gate" in pname and p.numel() == 1:
                p.fill_(0.5)
    return model.eval()


def hf_image_inputs(model, text_tokens: int) -> dict:
    """One 4-tile image (aspect 2x2) after an <|image|> token at the start of `text_tokens` tokens."""
    import torch
    vc = model.config.vision_config
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(10, 128000, (1, text_tokens), device="cuda", generator=g)
    ids[0, 0] = model.config.image_token_index
    pixels = torch.randn(1, 1, 4, 3, vc.image_size, vc.image_size, device="cuda", generator=g, dtype=torch.bfloat16)
    xmask = torch.ones(1, text_tokens, 1, 4, dtype=torch.long, device="cuda")
    return dict(input_ids=ids, pixel_values=pixels, cross_attention_mask=xmask,
                aspect_ratio_ids=torch.tensor([[6]], device="cuda"),  # (2, 2) in MllamaImageProcessor's list
                aspect_ratio_mask=torch.ones(1, 1, 4, dtype=torch.long, device="cuda"))


def hf_text_inputs(tokens: int) -> dict:
    import torch
    g = torch.Generator(device="cuda").manual_seed(1)
    return dict(input_ids=torch.randint(10, 128000, (1, tokens), device="cuda", generator=g))


# ---- continuous batching (generate_batch, ContinuousBatchingManager): tools/bench/batch.py's baseline ----

def hf_model(cfg, weights, device):
    """transformers' Llama on the same weights and its attention implementation (sdpa unless flash attention is
    installed: continuous batching pages it itself, "paged|sdpa")."""
    model = hf_llama(cfg, weights, device)
    return model, model.config._attn_implementation


def hf_config(new_tokens: int):
    import transformers
    return transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                         pad_token_id=0)


def hf_cb_config(cuda_graphs: str):
    """HF's ContinuousBatchingConfig. "on" (the default): its CUDA graphs forced on (transformers turns them on by
    itself only where its attention needs no mask, i.e. with flash-attn installed) and its KV cache at HF_MEMORY of
    the free memory (its 0.9 leaves too little for its own graph warm-up: docs/performance.md); "auto": every
    field left to transformers; "off": graphs off."""
    if cuda_graphs == "auto":
        return None
    import transformers
    if cuda_graphs == "off":
        return transformers.ContinuousBatchingConfig(use_cuda_graph=False)
    return transformers.ContinuousBatchingConfig(use_cuda_graph=True, max_memory_percent=HF_MEMORY)


def hf_batch_seconds(model, prompts, new_tokens: int, cuda_graphs: str = "on") -> tuple[float, int]:
    """generate_batch of the prompts, new_tokens each: (seconds, tokens generated). Called outside inference mode
    (generate_batch runs under no_grad): transformers 5.17 warms its manager up in the calling thread and generates
    in its own, where tensors made in the caller's inference mode cannot be updated in place."""
    sync()
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=hf_config(new_tokens),
                               continuous_batching_config=hf_cb_config(cuda_graphs))
    sync()
    return time.perf_counter() - t0, sum(len(o.generated_tokens) for o in out.values())


def hf_decode_rate(model, prompts, steps: int, cuda_graphs: str = "on") -> float | None:
    """Decode tok/s of generate_batch: (1 + steps tokens each) minus (1 token each: the prefill, and the manager's
    set-up and CUDA-graph warm-up, which every call repeats), after a warm-up call. None if the difference drowns in
    noise."""
    hf_batch_seconds(model, prompts[:2], 2, cuda_graphs)
    short, first = hf_batch_seconds(model, prompts, 1, cuda_graphs)
    full, tokens = hf_batch_seconds(model, prompts, 1 + steps, cuda_graphs)
    if first != len(prompts) or tokens != len(prompts) * (1 + steps):  # requests dropped: HF's run failed
        print(f"HF generate_batch at B={len(prompts)} returned {tokens} of {len(prompts) * (1 + steps)} tokens: "
              f"not timed", flush=True)
        return None
    return (tokens - len(prompts)) / (full - short) if full > short else None


def hf_workload(model, requests, cuda_graphs: str = "on") -> dict:
    """The workload through HF's ContinuousBatchingManager, each request with its own max_new_tokens. The manager
    is sized as generate_batch sizes it (workload hints: the longest prompt and output, the request count) and
    warmed up (its CUDA graphs captured, where it uses them) before the clock starts."""
    from transformers.generation.continuous_batching.utils import WorkloadHints
    longest = max(n for _, n in requests)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p, _ in requests), max_generated_length=longest,
                          num_requests=len(requests))
    manager = model.init_continuous_batching(generation_config=hf_config(longest),
                                             continuous_batching_config=hf_cb_config(cuda_graphs),
                                             workload_hints=hints)
    manager.warmup()
    cb = manager.continuous_batching_config  # as resolved: the sizes and graphs HF runs with
    chosen = {k: getattr(cb, k, None) for k in ("block_size", "num_blocks", "max_batch_tokens",
                                                 "max_requests_per_batch", "use_cuda_graph", "use_async_batching")}
    manager.start()
    try:
        sync()
        t0 = time.perf_counter()
        for i, (p, n) in enumerate(requests):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
        tokens, done = 0, 0
        while done < len(requests):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError(f"HF's manager stopped after {done} of {len(requests)} requests")
            if result.is_finished():
                done += 1
                tokens += len(result.generated_tokens)
        sync()
        elapsed = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    want = sum(n for _, n in requests)
    if tokens != want:  # a request that failed still finishes, with fewer tokens
        raise RuntimeError(f"HF's manager made {tokens} of the {want} tokens asked for")
    return {"seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed, "config": chosen}
