"""Image fine-tuning data for Llama 3.2 Vision: JSONL conversations with images -> token ids, labels and images.

A line is a text sample (refimpl.train.data) plus its images, in either of the forms HF's Mllama chat template and
processor read:
    {"messages": [{"role": "user", "content": "What is this?"}, ...], "images": ["cat.png"]}
        string contents; the images go first in the first user turn, unless the text places them itself with
        <|image|> tokens;
    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": "A cat."}], "images": ["cat.png"]}
        content parts; each {"type": "image"} part takes the next file of "images" (or its own "path").
Paths are relative to the data file. The conversation renders through the checkpoint's chat template and is
tokenized as MllamaProcessor tokenizes it; the labels are the text path's (the final assistant turn). Images are
decoded once when the file is read (so a bad one is named with its line) and again, through the real processor
(tiles, aspect ratio id and mask), when the sample's batch runs: a dataset's pixels are never all in memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from refimpl.errors import DataError, ImageError
from refimpl.train.data import IGNORE, Sample, encode_conversation, record_messages
from refimpl.vision.image_io import load_image
from refimpl.vision.inputs import ImageInputs
from refimpl.vision.prepare import checked_image_token, image_inputs, load_images, processor_config
from refimpl.vision.processor import ImageProcessorConfig
from refimpl.vision.prompt import IMAGE_TOKEN, cross_attention_mask, processor_ids

PART_TYPES = ("text", "image")


@dataclass(frozen=True)
class ImageSample(Sample):
    images: tuple[Path, ...] = ()  # [I] image files, in the order of the sample's <|image|> tokens


@dataclass(frozen=True)
class VisionData:
    """What turns a vision sample's files into model inputs: the processor settings and the model's vision config."""

    processor: ImageProcessorConfig
    cfg: object  # refimpl.model.vision_config.MllamaConfig
    image_id: int  # the <|image|> token id

    @classmethod
    def for_checkpoint(cls, model_dir: Path, cfg, tokenizer) -> "VisionData":
        image_id = checked_image_token(cfg, tokenizer)
        return cls(processor_config(model_dir, cfg), cfg, image_id)

    def inputs(self, sample: ImageSample) -> ImageInputs | None:
        """The sample's images through the processor, with its [T, I, A] cross-attention mask; None without."""
        if not sample.images:
            return None
        batch = load_images(sample.images, self.processor)
        mask = cross_attention_mask(sample.ids, self.image_id, batch.num_tiles, self.processor.max_image_tiles)
        return image_inputs(self.cfg, batch, mask)


def _content_parts(content, where: str) -> bool:
    """Accept a list of {"type": "text", "text": str} / {"type": "image"[, "path": str]} parts (raise otherwise)."""
    if not isinstance(content, list) or not content:
        raise DataError(f"{where}: 'content' must be a string or a non-empty list of {{'type': 'text' | 'image'}} "
                        f"parts, got {type(content).__name__}")
    for j, part in enumerate(content):
        ok = isinstance(part, dict) and part.get("type") in PART_TYPES and (
            isinstance(part.get("text"), str) if part["type"] == "text" else
            isinstance(part.get("path", ""), str))
        if not ok:
            raise DataError(f"{where}, part {j}: expected {{'type': 'text', 'text': str}} or {{'type': 'image'}} "
                            f"(optionally with a 'path'), got {str(part)[:80]}")
        other = [key for key in ("url", "image", "base64") if part["type"] == "image" and key in part]
        if other:  # never silently dropped: the image would come from 'images' instead
            raise DataError(f"{where}, part {j}: image parts take a file 'path' (or the next of 'images'); "
                            f"{other[0]!r} is not read")
    return True


def _image_parts(messages: list[dict]) -> list[tuple[int, dict]]:
    return [(i, part) for i, m in enumerate(messages) if isinstance(m["content"], list)
            for part in m["content"] if part["type"] == "image"]


def _place_images(messages: list[dict], files: list, where: str) -> tuple[list[dict], list]:
    """(messages with an image part for every file that has no <|image|> of its own, the image files in order)."""
    parts = _image_parts(messages)
    with_path = [part for _, part in parts if "path" in part]
    if with_path and files:
        raise DataError(f"{where}: images are given both as 'images' and as 'path' in content parts; use one")
    if with_path:
        if len(with_path) != len(parts):
            raise DataError(f"{where}: some image parts have a 'path' and some do not; give every one a path")
        return messages, [part["path"] for _, part in parts]
    literal = any(IMAGE_TOKEN in m["content"] for m in messages if isinstance(m["content"], str))
    if files and not parts and not literal:  # Llama 3.2 Vision's layout: the images open the first user turn
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first is None:
            raise DataError(f"{where}: images are given but the conversation has no user turn to hold them")
        m = messages[first]
        text = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
        messages = [*messages[:first], {**m, "content": [{"type": "image"}] * len(files) + text},
                    *messages[first + 1:]]
    return messages, files


def _resolve(files: list, data_path: Path, where: str) -> tuple[Path, ...]:
    """Image paths relative to the data file, each decoded once now so a bad file is named with its line."""
    out = []
    for f in files:
        path = Path(f) if Path(f).is_absolute() else Path(data_path).parent / f
        try:
            load_image(path)
        except ImageError as e:
            raise DataError(f"{where}: {e}") from None
        out.append(path)
    return tuple(out)


def image_record_encoder(data_path: Path, tokenizer, vd: VisionData):
    """`encode_record(record, line) -> ImageSample` for refimpl.train.data.load_samples."""
    bos = tokenizer.bos_token

    def encode(text: str) -> list[int]:
        # as MllamaProcessor: a template that emits its own BOS gets no second one
        return processor_ids(tokenizer, text, add_special_tokens=not (bos and text.startswith(bos)))

    def encode_record(record, line: int) -> ImageSample:
        where = f"{data_path}:{line}"
        messages = record_messages(record, where, content_ok=_content_parts)
        files = record.get("images", [])
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise DataError(f"{where}: 'images' must be a list of image file paths (strings)")
        messages, files = _place_images(messages, files, where)
        if any(role == "assistant" for role in (messages[i]["role"] for i, _ in _image_parts(messages))):
            raise DataError(f"{where}: an image part is in an assistant turn; images belong in user turns")
        ids, labels = encode_conversation(tokenizer, messages, where, encode)
        tokens = ids.count(vd.image_id)
        if tokens != len(files):
            raise DataError(f"{where}: the conversation has {tokens} {IMAGE_TOKEN} token(s) but {len(files)} "
                            f"image(s) are given; each {IMAGE_TOKEN} pairs with one image, in order")
        if any(t == vd.image_id for t, label in zip(ids, labels) if label != IGNORE):
            raise DataError(f"{where}: the final assistant turn holds an {IMAGE_TOKEN} token; images belong in "
                            f"user turns")
        return ImageSample(line, ids, labels, _resolve(files, data_path, where))

    return encode_record
