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


# ---------------------------------------------------------------- the toy vision checkpoint

VISION_TOY_NAME = "toy-vision"
TILE = 28  # pixels: 2×2 patches of 14 and a class token per tile
# 30 rows × 80 columns: a 1×3 tile canvas (3 tiles), resized to 28×74 and zero-padded on the right
TOY_IMAGE_SIZE = (30, 80)
TOY_PROMPT = "Look at this picture: <|image|> and tell me about the sea in it."


def toy_vision_config():
    """GQA (4 query heads on 2 kv heads), cross-attention at layers 1 and 3 of 4, llama3 rope scaling."""
    from refimpl.model.vision_config import MllamaConfig
    from tools.toy import MERGES, SPECIAL_TOKENS, special_id

    vocab = 256 + len(MERGES) + len(SPECIAL_TOKENS)  # <|image|> is the next id: the first extra embedding row
    eos = [special_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
    return MllamaConfig.from_hf({
        "model_type": "mllama", "image_token_index": vocab,
        "text_config": {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
                        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                        "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "cross_attention_layers": [1, 3],
                        "bos_token_id": special_id("<|begin_of_text|>"), "eos_token_id": eos,
                        "tie_word_embeddings": False},
        "vision_config": {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
                          "num_global_layers": 1, "attention_heads": 4, "image_size": TILE, "patch_size": 14,
                          "max_num_tiles": 4, "vision_output_dim": 96, "intermediate_layers_indices": [0, 2],
                          "norm_eps": 1e-5},
    }, source="toy-vision config")


def random_vision_params(cfg, seed: int = 0) -> dict:
    """Seeded float32 weights at the checkpoint's shapes, in the Hub's names, none inert: every tanh gate (the
    encoder's and the cross layers') ±U(0.3, 1.2), signs alternating — open, far from tanh's saturation, where HF's
    zero-initialised gates would hide the image; norms 1 + N(0, 0.2²); biases N(0, 0.1²); the token, class,
    position and tile embeddings N(0, 0.5²); matrices and the patch convolution N(0, 1/fan_in) (fan-in: everything
    after the output axis), the lm_head 3× that, so logits spread (std ~3) as a trained model's do."""
    import numpy as np

    from refimpl.formats.vision_checkpoint import expected_vision_shapes

    rng = np.random.default_rng(seed)
    params, gates = {}, 0
    for name, shape in expected_vision_shapes(cfg).items():
        leaf = name.rsplit(".", 1)[-1]
        if "gate" in leaf:  # gate, gate_attn, gate_ffn, cross_attn_attn_gate, cross_attn_mlp_gate (gate_proj: weight)
            value = rng.uniform(0.3, 1.2, shape) * (-1.0) ** gates
            gates += 1
        elif leaf == "bias":
            value = 0.1 * rng.standard_normal(shape)
        elif "norm" in name:  # layer norms and RMSNorms (incl. q_norm / k_norm): near 1, not 1
            value = 1.0 + 0.2 * rng.standard_normal(shape)
        elif "embedding" in name or "embed_tokens" in name:
            value = 0.5 * rng.standard_normal(shape)
        else:
            scale = 3.0 if name.endswith("lm_head.weight") else 1.0
            value = scale * rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        params[name] = value.astype(np.float32)
    return params


def toy_image():
    """A deterministic RGB picture: smooth gradients plus noise, so resizing and every channel matter."""
    import numpy as np
    from PIL import Image

    h, w = TOY_IMAGE_SIZE
    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(7)
    rgb = np.stack([255 * x / w, 255 * y / h, 128 + 60 * np.sin(x / 5.0)], axis=-1)  # [h, w, 3]
    rgb = rgb + 20 * rng.standard_normal((h, w, 3))
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))


def write_vision_toy(out_dir, seed: int = 3):
    """The complete HF mllama directory (config, preprocessor config, tokenizer, chat template, generation config,
    safetensors in the Hub's key names) plus the toy image; the same bytes on every run."""
    import json
    from pathlib import Path

    from refimpl.formats.checkpoint import save_checkpoint

    cfg = toy_vision_config()
    model_dir = save_checkpoint(Path(out_dir) / VISION_TOY_NAME, cfg, random_vision_params(cfg, seed))

    def write(name, data):
        (model_dir / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    hf_config = cfg.to_hf()
    # HF sizes embed_tokens' padding_idx from pad_token_id (128004 by default, outside a toy vocabulary)
    hf_config["text_config"]["pad_token_id"] = cfg.eos_token_ids[0]
    write("config.json", hf_config)
    build_vision_tokenizer().save(str(model_dir / "tokenizer.json"))
    write("tokenizer_config.json", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                    "model_max_length": cfg.max_position_embeddings,
                                    "tokenizer_class": "PreTrainedTokenizerFast"})
    (model_dir / "chat_template.jinja").write_text(VISION_CHAT_TEMPLATE, encoding="utf-8")
    write("preprocessor_config.json", preprocessor_config(TILE, cfg.vision.max_num_tiles))
    write("generation_config.json", {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids),
                                     "do_sample": False})
    toy_image().save(model_dir / "image.png", format="PNG")
    return model_dir
