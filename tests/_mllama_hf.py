"""Tiny random HF MllamaForConditionalGeneration models (the oracle) and their inputs, for the vision tests.

Every gate is set to a nonzero value: HF zero-initialises the cross-attention and aspect-ratio gates, which would
hide the image from the text entirely.
"""
from __future__ import annotations

import numpy as np
import torch
from transformers import MllamaConfig as HFMllamaConfig
from transformers import MllamaForConditionalGeneration
from transformers.models.mllama.processing_mllama import (convert_sparse_cross_attention_mask_to_dense,
                                                           get_cross_attention_token_mask)

from refimpl.formats.vision_checkpoint import hub_name

VOCAB = 120  # text vocab; the image token is VOCAB (the first of the 8 extra embedding rows)
IMAGE = VOCAB
TILE = 28  # pixels: 2×2 patches of 14 + a class token = 5 tokens per tile, padded to 8


def hf_config(kv_heads: int = 2, rope_scaling: bool = True, cross_layers=(1, 3), text_layers: int = 4,
              tile: int = TILE, image_token: int = IMAGE) -> dict:
    rope = ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 16} if rope_scaling
            else {"rope_type": "default", "rope_theta": 10000.0})
    return dict(
        image_token_index=image_token,
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=text_layers,
                         num_attention_heads=4, num_key_value_heads=kv_heads, rope_parameters=rope,
                         rms_norm_eps=1e-5, max_position_embeddings=512, cross_attention_layers=list(cross_layers),
                         bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
                         initializer_range=0.15),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_global_layers=1,
                           attention_heads=4, image_size=tile, patch_size=14, max_num_tiles=4,
                           vision_output_dim=32 * 3, intermediate_layers_indices=[0, 2], norm_eps=1e-5),
    )


def hf_model(seed: int = 0, **kw) -> MllamaForConditionalGeneration:
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(HFMllamaConfig(**hf_config(**kw))).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "gate" in name and param.numel() == 1:  # every tanh gate nonzero, signs mixed
                param.copy_(torch.empty(1).uniform_(0.3, 1.2, generator=g) * (1 if len(name) % 2 else -1))
            elif "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=g))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=g))
            elif "embedding" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=g))  # positions and tiles matter visibly
    return model


def ref_params(model) -> dict[str, np.ndarray]:
    """The model's tensors as float32 NumPy, in the Hub's names."""
    return {hub_name(k): v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


def image_arrays(tiles_per_image: list[tuple[int, int]], seed: int = 0, max_tiles: int = 4, tile: int = TILE):
    """pixel_values [I, A, 3, X, X] (zeros in padding tiles), aspect_ratio_ids [I], aspect_ratio_mask [I, A] for
    images of the given (rows, columns) tile grids, in the layout MllamaImageProcessor returns."""
    ratios = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1)]
    rng = np.random.default_rng(seed)
    I = len(tiles_per_image)
    pixels = np.zeros((I, max_tiles, 3, tile, tile), np.float32)
    ids = np.zeros(I, np.int64)
    mask = np.zeros((I, max_tiles), np.int64)
    for i, grid in enumerate(tiles_per_image):
        n = grid[0] * grid[1]
        pixels[i, :n] = rng.standard_normal((n, 3, tile, tile)).astype(np.float32)
        ids[i] = ratios.index(grid) + 1
        mask[i, :n] = 1
    return pixels, ids, mask


def cross_mask(ids: list[int], tiles: list[int], max_tiles: int = 4, image_token: int = IMAGE) -> np.ndarray:
    """[T, I, A] from HF's own MllamaProcessor helpers (image token to the next one or the end)."""
    spans = get_cross_attention_token_mask(ids, image_token)
    return convert_sparse_cross_attention_mask_to_dense([spans], [tiles], max_tiles, len(ids))[0]


def hf_logits(model, ids, pixels=None, ar_ids=None, ar_mask=None, xmask=None) -> np.ndarray:
    kw = {}
    if pixels is not None:
        kw = dict(pixel_values=torch.from_numpy(pixels)[None], aspect_ratio_ids=torch.from_numpy(ar_ids)[None],
                  aspect_ratio_mask=torch.from_numpy(ar_mask)[None])
    if xmask is not None:
        kw["cross_attention_mask"] = torch.from_numpy(xmask)[None]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), **kw).logits[0].float().numpy()
