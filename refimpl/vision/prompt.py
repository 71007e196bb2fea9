"""Llama 3.2 Vision prompts, token for token as HF's `MllamaProcessor`: where `<|image|>` and `<|begin_of_text|>`
go, and which image(s) each text token may attend to (the cross-attention mask).

An `<|image|>` token stands for one image, in order; the model sees images only through cross-attention, so the
token is not expanded. Each text token attends to the image of the last `<|image|>` at or before it — a run of
consecutive `<|image|>` tokens counts as one group, all of whose images stay visible until the next group —
and text before the first image token sees no image at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refimpl.errors import GenerationError

IMAGE_TOKEN = "<|image|>"


@dataclass
class VisionPrompt:
    """A prompt ready for the vision model: ids and the cross-attention mask that pairs them with images."""

    ids: list[int]  # [T]
    cross_attention_mask: np.ndarray  # [T, I, A] int64, 1 where token t may attend to tile a of image i


def with_bos(prompt: str, bos_token: str, image_token: str = IMAGE_TOKEN) -> str:
    """The prompt with `bos_token` after any leading image tokens (Meta's layout "<|image|><|begin_of_text|>..."),
    unchanged when it already holds a BOS anywhere."""
    if bos_token in prompt:
        return prompt
    leading = 0
    while prompt.startswith(image_token):
        prompt, leading = prompt[len(image_token):], leading + 1
    return image_token * leading + bos_token + prompt


def image_spans(ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """For each image token, in order, the [start, end) token range that may attend to its image."""
    starts = [t for t, token in enumerate(ids) if token == image_token_id]
    ends = starts[1:] + [len(ids)]  # an image is visible until the next image token
    spans = [[s, e] for s, e in zip(starts, ends)]
    # walking back, an image token followed directly by another shares that one's end: the group stays visible
    later_end = len(ids)
    for span in reversed(spans):
        if span[1] == span[0] + 1:
            span[1] = later_end
        later_end = span[1]
    return [(s, e) for s, e in spans]


def cross_attention_mask(ids: list[int], image_token_id: int, num_tiles: list[int],
                         max_image_tiles: int) -> np.ndarray:
    """[T, I, A] int64: 1 where token t may attend to tile a of image i (only the image's own tiles)."""
    mask = np.zeros((len(ids), len(num_tiles), max_image_tiles), dtype=np.int64)  # [T, I, A]
    for i, ((start, end), tiles) in enumerate(zip(image_spans(ids, image_token_id), num_tiles)):
        mask[start:end, i, :tiles] = 1
    return mask


def count_check(n_tokens: int, n_images: int, where: str = "the prompt") -> None:
    if n_tokens != n_images:
        raise GenerationError(f"{where} has {n_tokens} {IMAGE_TOKEN} token(s) but {n_images} image(s) were given; "
                              f"each {IMAGE_TOKEN} pairs with one --image, in order")


def image_token_id(tokenizer) -> int:
    token_id = tokenizer.tok.token_to_id(IMAGE_TOKEN)
    if token_id is None:
        raise GenerationError(f"{tokenizer.source}: the tokenizer has no {IMAGE_TOKEN} token; "
                              f"expected a Llama 3.2 Vision tokenizer")
    return token_id


def processor_ids(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Text -> ids as `MllamaProcessor` tokenizes it: BOS placed by `with_bos`, then the tokenizer's own BOS
    too when add_special_tokens. HF keeps both ("<|begin_of_text|><|begin_of_text|>text <|image|>"), so the raw
    tokenizer is called: TextTokenizer.encode would fold them into one and drift from HF's ids."""
    return tokenizer.tok.encode(with_bos(text, tokenizer.bos_token or ""), add_special_tokens=add_special_tokens).ids


def raw_prompt_ids(tokenizer, prompt: str, n_images: int) -> list[int]:
    """A plain-text prompt -> ids as `MllamaProcessor(text=prompt, images=...)` gives them. Without any image
    token, one per image is put first, as the chat template places images before the text."""
    if IMAGE_TOKEN not in prompt:
        prompt = IMAGE_TOKEN * n_images + prompt
    count_check(prompt.count(IMAGE_TOKEN), n_images)
    return processor_ids(tokenizer, prompt)


def chat_messages(prompt: str, n_images: int, system: str | None = None) -> list[dict]:
    """One user turn in the content-parts form Llama 3.2 Vision templates read: the images first (unless the
    text places them with its own image tokens), then the text."""
    parts = [] if IMAGE_TOKEN in prompt else [{"type": "image"}] * n_images
    parts = parts + [{"type": "text", "text": prompt}]
    system_turn = [{"role": "system", "content": system}] if system else []  # a string: every template reads it
    return system_turn + [{"role": "user", "content": parts}]


def chat_prompt_ids(tokenizer, messages: list[dict], n_images: int) -> list[int]:
    """Messages with {"type": "image"} parts -> ids, as `MllamaProcessor.apply_chat_template(tokenize=True)`."""
    text = tokenizer.render_chat(messages)
    count_check(text.count(IMAGE_TOKEN), n_images, "the chat prompt")
    # a template that emits its own BOS gets no second one (HF's processor passes add_special_tokens=False)
    bos = tokenizer.bos_token
    return processor_ids(tokenizer, text, add_special_tokens=not (bos and text.startswith(bos)))


def build_vision_prompt(tokenizer, prompt: str, num_tiles: list[int], max_image_tiles: int, chat: bool = False,
                        system: str | None = None) -> VisionPrompt:
    """The prompt's ids for its images (num_tiles: tiles of each image, in order) and its cross-attention mask."""
    image_id = image_token_id(tokenizer)
    if chat and tokenizer.chat_template is None:  # the built-in Llama 3 fallback reads string contents only
        text = prompt if IMAGE_TOKEN in prompt else IMAGE_TOKEN * len(num_tiles) + prompt
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        ids = chat_prompt_ids(tokenizer, messages, len(num_tiles))
    elif chat:
        ids = chat_prompt_ids(tokenizer, chat_messages(prompt, len(num_tiles), system), len(num_tiles))
    else:
        ids = raw_prompt_ids(tokenizer, prompt, len(num_tiles))
    return VisionPrompt(ids, cross_attention_mask(ids, image_id, num_tiles, max_image_tiles))
