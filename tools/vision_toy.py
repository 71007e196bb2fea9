"""The toy vision checkpoint's input side: a tokenizer with `<|image|>`, a Llama 3.2 Vision style chat template
(content as a list of parts) and the image processor settings, at toy size (golden files, tests)."""
from __future__ import annotations

from tools.toy import build_tokenizer

IMAGE_TOKEN = "<|image|>"

# Llama 3.2 Vision Instruct's template shape: BOS, a system turn, then each message's content either a string or
# a list of {"type": "image"} / {"type": "text", "text": ...} parts, an image part rendering as <|image|>.
VISION_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is string %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- else %}{%- set system_message = messages[0]['content'][0]['text'] | trim %}{%- endif %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{%- if system_message %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' + system_message + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' %}{{- '<|image|>' }}"
    "{%- elif content['type'] == 'text' %}{{- content['text'] | trim }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)


def build_vision_tokenizer():
    """The toy tokenizer plus `<|image|>` as the last id (Llama 3.2 Vision's 128256 = the text vocabulary size)."""
    from tokenizers import AddedToken

    tok = build_tokenizer()
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    return tok


def preprocessor_config(tile_size: int, max_image_tiles: int = 4) -> dict:
    """preprocessor_config.json as the Hub's Llama 3.2 Vision ships it, at another tile size."""
    return {
        "do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "MllamaImageProcessor", "max_image_tiles": max_image_tiles,
        "processor_class": "MllamaProcessor", "resample": 2, "rescale_factor": 0.00392156862745098,
        "size": {"height": tile_size, "width": tile_size},
    }
