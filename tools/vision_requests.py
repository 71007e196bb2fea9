"""Requests for a Llama 3.2 Vision checkpoint in `llama32 batch` and `llama32 serve`: prompt ids and image inputs as
`llama32 generate --image` builds them (MllamaProcessor's tokenization, tiling and cross-attention mask).

`llama32 batch` lines (`VisionPrompts.build`):

    {"id", "prompt": str, "images": [paths]}    as `generate PROMPT --image ...`: without <|image|> tokens in the
                                                text, one per image goes first
    {"id", "messages": [...], "images": [...]}  the chat template; string contents, the images opening the first
                                                user turn (as `generate --chat --image` places them) unless the text
                                                holds its own <|image|> tokens
Image paths are relative to the input file. Every image is read and tiled when the file is checked, so a missing or
unreadable one is an error naming FILE:LINE before any work starts.

`llama32 serve` chats (`VisionPrompts.chat`): messages whose contents are strings or text and image parts, with the
decoded images in order.
"""
from __future__ import annotations

from pathlib import Path

from refimpl.errors import GenerationError
from refimpl.vision.prepare import checked_image_token, image_inputs, load_images, processor_config
from refimpl.vision.processor import preprocess
from refimpl.vision.prompt import IMAGE_TOKEN, chat_prompt_ids, cross_attention_mask, raw_prompt_ids


class VisionPrompts:
    def __init__(self, ckpt, input_path: Path | None = None):
        """input_path: the batch input file (image paths are relative to it)."""
        self.cfg, self.tokenizer = ckpt.config, ckpt.tokenizer
        self.processor = processor_config(Path(ckpt.path), ckpt.config)
        self.image_id = checked_image_token(ckpt.config, ckpt.tokenizer)
        self.base = Path(input_path).parent if input_path is not None else Path.cwd()

    def build(self, obj: dict, files: tuple[str, ...]):
        """A checked line's prompt and images -> (prompt ids, ImageInputs or None); GenerationError or ImageError
        if they disagree or an image cannot be read (the caller names the line)."""
        paths = [Path(f) if Path(f).is_absolute() else self.base / f for f in files]
        batch = load_images(paths, self.processor) if paths else None
        if "prompt" in obj:
            ids = raw_prompt_ids(self.tokenizer, obj["prompt"], len(paths))
        else:
            ids = chat_prompt_ids(self.tokenizer, self._place_images(obj["messages"], len(paths)), len(paths))
        return ids, self._inputs(ids, batch)

    def chat(self, messages: list[dict], images: list):
        """Messages (string contents, or lists of {"type": "text", "text"} and {"type": "image"} parts, one image
        part per image, in order) and the decoded RGB images -> (prompt ids, ImageInputs or None)."""
        batch = preprocess(images, self.processor) if images else None
        if self.tokenizer.chat_template is None:  # the built-in template reads string contents only
            messages = [{**m, "content": m["content"] if isinstance(m["content"], str) else "".join(
                IMAGE_TOKEN if p["type"] == "image" else p["text"] for p in m["content"])} for m in messages]
        ids = chat_prompt_ids(self.tokenizer, messages, len(images))
        return ids, self._inputs(ids, batch)

    def _inputs(self, ids: list[int], batch):
        if batch is None:
            return None
        mask = cross_attention_mask(ids, self.image_id, batch.num_tiles, self.processor.max_image_tiles)
        return image_inputs(self.cfg, batch, mask)

    def _place_images(self, messages: list[dict], n: int) -> list[dict]:
        """The images open the first user turn, as image parts (a string when the template is the built-in one,
        which reads string contents only), unless the text places them with its own <|image|> tokens."""
        if not n or any(IMAGE_TOKEN in m["content"] for m in messages):
            return messages
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first is None:
            raise GenerationError("images are given but the conversation has no user turn to hold them")
        m = messages[first]
        if self.tokenizer.chat_template is None:
            content = IMAGE_TOKEN * n + m["content"]
        else:
            content = [{"type": "image"}] * n + [{"type": "text", "text": m["content"]}]
        return [*messages[:first], {**m, "content": content}, *messages[first + 1:]]
