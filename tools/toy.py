"""Toy checkpoints with Llama 3.2's real structure at toy size, built deterministically (golden files, tests).

A toy checkpoint is a complete Hugging Face directory, the same files a user downloads:
    config.json              GQA, llama3 rope scaling with a small original_max_position_embeddings, tied embeddings
    model.safetensors        fp32 weights from a seeded NumPy generator (PCG64 is the same on every platform)
    tokenizer.json           a real byte-level BPE: 256 byte tokens, a few English merges, Llama 3's special tokens,
                             Llama 3's pre-tokenizer regex and a post-processor that adds <|begin_of_text|>
    tokenizer_config.json    bos/eos and a Llama 3 style chat_template
    generation_config.json   the instruct models' three stop ids
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refimpl.formats.checkpoint import save_checkpoint

from refimpl.formats.params import expected_shapes
from refimpl.model.config import LlamaConfig, RopeScaling
from refimpl.text.tokenizer import LLAMA3_TEMPLATE, gpt2_bytes_to_unicode, llama3_pre_tokenizer

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eom_id|>", "<|eot_id|>")  # Llama 3's order (128000, 128001, 128006..128009)

# Merges in priority order; each joins two tokens already in the vocabulary ("Ġ" is the byte-level space, "Ċ" \n).
MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"), ("Ġ", "a"),
          ("r", "e"), ("Ġ", "s"), ("e", "n"), ("a", "t"), ("o", "r"), ("i", "s"), ("Ġ", "w"), ("e", "s"),
          ("Ġ", "o"), ("i", "t"), ("Ġ", "c"), ("e", "d"), ("n", "d"), ("Ġa", "nd"), ("Ċ", "Ċ"), ("s", "e"),
          ("u", "se"), ("use", "r"))

VOCAB_SIZE = 256 + len(MERGES) + len(SPECIAL_TOKENS)  # 288: the tokenizer fills the embedding table exactly

CHAT_TEMPLATE = LLAMA3_TEMPLATE  # Llama 3's header format, as the built-in fallback renders it


def build_tokenizer():
    """A `tokenizers.Tokenizer`: ids 0..255 are the bytes in order, then the merges, then the special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    chars = gpt2_bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    for left, right in MERGES:
        assert left in vocab and right in vocab, (left, right)  # a merge must join existing tokens
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES), ignore_merges=True))
    tok.pre_tokenizer = llama3_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.token_to_id(bos))])
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    return tok


def special_id(token: str) -> int:
    return 256 + len(MERGES) + SPECIAL_TOKENS.index(token)


@dataclass(frozen=True)
class ToySpec:
    """One toy model: a name (its directory), a config and a weight seed."""

    name: str
    config: LlamaConfig
    seed: int


def _toy_config(**kw) -> LlamaConfig:
    eos = tuple(special_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"))
    # original_max_position_embeddings 32: golden positions run well past it, so all three llama3 frequency
    # bands matter (wavelength < 8 kept, 8..32 interpolated, > 32 divided by the factor).
    return LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
                       rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                original_max_position_embeddings=32),
                       bos_token_id=special_id("<|begin_of_text|>"), eos_token_ids=eos,
                       max_position_embeddings=128, **kw)


TOYS: tuple[ToySpec, ...] = (
    # GQA ratio 2, head_dim = hidden / heads; theta 1e4 so that head_dim 16 has a band in each llama3 range.
    ToySpec("toy-gqa", _toy_config(intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, rope_theta=10000.0), seed=1),
    # MQA (ratio 4) with an explicit head_dim 32 != hidden / heads = 16 (q_size 128 != hidden 64), Llama's theta.
    ToySpec("toy-mqa", _toy_config(intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=32, rope_theta=500000.0), seed=2),
)


def toy_params(cfg: LlamaConfig, seed: int) -> dict[str, np.ndarray]:
    """Weights scaled 1/sqrt(fan_in) so activations stay O(1) and attention is far from uniform.

    (random_params' std 0.02 would give q·k ≈ 0 at hidden 64: every attention row uniform, and a wrong causal
    mask or rotation would hardly show.) Norm weights near 1 but not 1, so a skipped weight multiply shows.
    """
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            params[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        elif name == "model.embed_tokens.weight":
            params[name] = rng.standard_normal(shape, dtype=np.float32)
        else:
            params[name] = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[1]))
    return params


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_toy_checkpoint(spec: ToySpec, out_dir: str | Path) -> Path:
    """Write the complete HF directory for `spec` into out_dir/spec.name; same bytes on every run."""
    cfg = spec.config
    model_dir = save_checkpoint(Path(out_dir) / spec.name, cfg, toy_params(cfg, spec.seed))
    build_tokenizer().save(str(model_dir / "tokenizer.json"))
    _write_json(model_dir / "tokenizer_config.json", {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": cfg.max_position_embeddings, "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": True})
    _write_json(model_dir / "generation_config.json", {
        "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids), "do_sample": False})
    return model_dir
