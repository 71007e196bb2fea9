"""`--image` for the CLI commands: a prompt and image files -> prompt ids and the engine's image inputs."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from refimpl.errors import GenerationError
from refimpl.family import family_of


@dataclass
class PromptInputs:
    ids: list[int]
    engine_kwargs: dict = field(default_factory=dict)  # images=ImageInputs for a vision engine, else empty
    record: dict = field(default_factory=dict)  # what --json reports about the images


def prompt_inputs(ckpt, prompt: str, image_paths: tuple[Path, ...] | list[Path], chat: bool,
                  system: str | None = None) -> PromptInputs | None:
    """Ids and image inputs for a Llama 3.2 Vision checkpoint (prompts built as MllamaProcessor builds them);
    None for a text-only checkpoint without --image (the caller's usual path)."""
    if not family_of(ckpt.config).takes_images:
        if image_paths:
            raise GenerationError(f"--image: {ckpt.path} is a text-only checkpoint; images need a Llama 3.2 "
                                  f"Vision checkpoint (config.json with model_type 'mllama')")
        return None
    if not prompt:
        raise GenerationError("the prompt is empty: give some text to continue")
    if not image_paths:  # text alone: the cross-attention layers are skipped, as HF does without pixel_values
        from refimpl.vision.prompt import build_vision_prompt
        vp = build_vision_prompt(ckpt.tokenizer, prompt, [], ckpt.config.vision.max_num_tiles, chat, system)
        return PromptInputs(vp.ids, {"images": None}, {"images": []})
    from refimpl.vision.prepare import prepare
    req = prepare(Path(ckpt.path), ckpt.config, ckpt.tokenizer, prompt, list(image_paths), chat, system)
    record = {"images": [{"path": str(path), "num_tiles": n, "aspect_ratio_id": int(ar)} for path, n, ar in
                         zip(image_paths, req.batch.num_tiles, req.batch.aspect_ratio_ids)]}
    return PromptInputs(req.prompt_ids, {"images": req.images}, record)


def forward_names(cfg, inputs: dict | None = None) -> list[str]:
    """The activation names of one forward: a vision engine's call given `inputs` (its images, or None)."""
    return family_of(cfg).forward_names(cfg, bool(inputs) and inputs.get("images") is not None)


def token_rows(cfg) -> int:
    """Ids a prompt may hold: a vision model's embedding has rows past the text vocabulary (<|image|>)."""
    return family_of(cfg).token_rows(cfg)
