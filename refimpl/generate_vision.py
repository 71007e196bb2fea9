"""The reference engine for Llama 3.2 Vision: RefEngine's contract plus the prompt's images.

`steps`, `logits` and `generate` take `images` (an `ImageInputs`) on the call that first sees the prompt; the
images are encoded once, each cross-attention layer keeps their keys/values in the cache, and later calls
(decode steps) need no image inputs. Generated tokens reuse the prompt's last cross-attention mask row.
"""
from __future__ import annotations

import numpy as np

from refimpl.errors import GenerationError
from refimpl.generate import RefEngine, Sampling, check_prompt
from refimpl.model import ops
from refimpl.model.llama_vision import VisionCache, forward_steps
from refimpl.vision.inputs import ImageInputs


class VisionEngine(RefEngine):
    """float32 NumPy, one sequence; `config` is a MllamaConfig."""

    def new_cache(self, capacity: int) -> VisionCache:
        try:
            return VisionCache.allocate(self.config.text, capacity, lambda shape: np.zeros(shape, np.float32))
        except MemoryError:
            t = self.config.text
            layers = t.num_hidden_layers - len(t.cross_attention_layers)
            need = 2 * layers * t.num_key_value_heads * capacity * t.head_dim * 4
            raise GenerationError(f"the KV cache for {capacity} positions needs {need / 2**30:.1f} GiB, more memory "
                                  f"than is available; lower --max-new-tokens or shorten the prompt") from None

    def steps(self, ids, positions, cache: VisionCache, last_logits_only: bool = False,
              images: ImageInputs | None = None):
        """The op-by-op forward (a generator of (name, value)): the vision encoder first when `images` is given."""
        return forward_steps(ops, self.params, self.config, np.asarray(ids, np.int64),
                             np.asarray(positions, np.int64), cache, images, last_logits_only)

    def check_prompt(self, prompt_ids: list[int], s: Sampling, context: int, start: int = 0,
                     images: ImageInputs | None = None) -> None:
        cfg = self.config
        check_prompt(prompt_ids, cfg.text.embedding_rows, s.max_new_tokens, context, start)
        check_images(prompt_ids, cfg.image_token_index, images)


def check_images(prompt_ids: list[int], image_token: int, images: ImageInputs | None) -> None:
    """One image per image token, and a cross-attention mask row per prompt token."""
    count = sum(1 for t in prompt_ids if t == image_token)
    given = 0 if images is None else images.num_images
    if count != given:
        raise GenerationError(f"the prompt has {count} <|image|> token(s) but {given} image(s) were given")
    mask = None if images is None else images.cross_attention_mask
    if mask is not None and len(mask) != len(prompt_ids):
        raise GenerationError(f"cross_attention_mask has {len(mask)} rows for a prompt of {len(prompt_ids)} tokens")
