"""An OpenAI request -> the engine's work: prompt ids, sampling parameters per choice, and the checks that turn
a request the engine cannot serve into a 400 before anything is queued."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from refimpl.errors import Llama32Error
from tools.serve.media import load_image_url
from tools.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest


@dataclass
class ServedModel:
    """What the server serves: the base model and its adapters by name, and what a request is checked against."""

    name: str
    tokenizer: object
    stop_ids: tuple[int, ...]
    context: int  # positions: prompt + max_tokens must fit
    vocab_rows: int  # ids a prompt may hold
    adapters: tuple[str, ...] = ()
    vision: bool = False
    image_prompts: object = None  # a vision model's tools.vision_requests.VisionPrompts
    allowed_media: Path | None = None
    sampling_fields: frozenset = field(default_factory=frozenset)  # what the engine's SamplingParams takes


@dataclass
class Job:
    """One prompt of a request: its ids and the parameters of each of its n choices."""

    prompt_ids: list[int]
    params: list  # SamplingParams, one a choice
    stops: list[str]
    adapter: str | None


def adapter_for(model: ServedModel, requested: str) -> str | None:
    if requested == model.name:
        return None
    if requested in model.adapters:
        return requested
    raise APIError(f"The model {requested!r} does not exist (served: {', '.join((model.name,) + model.adapters)})",
                   status=404, param="model", code="model_not_found")


def chat_prompt(model: ServedModel, req: ChatCompletionRequest):
    """-> (prompt ids, a vision model's ImageInputs or None). A vision model reads content parts as its chat
    template does (text and image parts in order, each image_url decoded here); a text model joins the text parts."""
    messages, images = [], []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            parts = []
            for j, part in enumerate(m.content):
                if part.type == "image_url":
                    param = f"messages.{i}.content.{j}.image_url"
                    if not model.vision:
                        raise APIError(f"{param}: {model.name} is a text-only model; images need a Llama 3.2 "
                                       f"Vision model", param=param)
                    images.append(load_image_url(part.image_url.url, param, model.allowed_media))
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": part.text})
            content = parts if model.vision else "\n".join(p["text"] for p in parts)
        else:
            content = m.content or ""
        role = "system" if m.role == "developer" else m.role
        messages.append({"role": role, "content": content})
    try:
        if model.image_prompts is not None:
            return model.image_prompts.chat(messages, images)
        return model.tokenizer.encode_chat(messages), None
    except Llama32Error as e:
        raise APIError(f"messages: {e}", param="messages") from None


def completion_prompts(model: ServedModel, req: CompletionRequest) -> list[list[int]]:
    out = []
    for i, p in enumerate(req.prompts()):
        if isinstance(p, str):
            if not p:
                raise APIError("prompt is empty", param="prompt")
            try:
                out.append(model.tokenizer.encode(p))
            except Llama32Error as e:
                raise APIError(f"prompt: {e}", param="prompt") from None
        elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            bad = [t for t in p if not 0 <= t < model.vocab_rows]
            if bad:
                raise APIError(f"prompt.{i}: token id {bad[0]} is outside the vocabulary (0..{model.vocab_rows - 1})",
                               param="prompt")
            out.append(list(p))
        else:
            raise APIError(f"prompt.{i}: expected a string or a non-empty list of token ids", param="prompt")
    return out


def sampling_params(model: ServedModel, req, make_params, prompt_len: int, max_tokens: int | None,
                    top_logprobs: int | None) -> list:
    """One SamplingParams a choice; the checks against the context and the engine's abilities."""
    room = model.context - prompt_len
    if room <= 0:
        raise APIError(f"This model's maximum context length is {model.context} tokens. However, your prompt has "
                       f"{prompt_len} tokens.", param="messages" if hasattr(req, "messages") else "prompt")
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise APIError(f"This model's maximum context length is {model.context} tokens. However, you requested "
                       f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                       f"completion). Please reduce the length of the prompt or the completion.",
                       param="max_tokens")
    wanted = {"max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
              "repetition_penalty": req.repetition_penalty, "stop_token_ids": tuple(model.stop_ids)}
    optional = {"presence_penalty": (req.presence_penalty, 0.0), "frequency_penalty": (req.frequency_penalty, 0.0),
                "logprobs": (top_logprobs, None)}
    for name, (value, neutral) in optional.items():
        if value != neutral:
            if name not in model.sampling_fields:
                raise APIError(f"{name} is not supported by this engine", param=name)
            wanted[name] = value
    params = []
    for i in range(req.n):
        seed = None if req.seed is None else req.seed + i
        params.append(make_params(**wanted, seed=seed))
    return params


def sampling_fields(params_cls) -> frozenset:
    return frozenset(f.name for f in dataclasses.fields(params_cls))
