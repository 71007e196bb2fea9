"""Every field a Hugging Face config can carry, decided once: implemented, ignored (with the reason it cannot change
the result), or refused unless it holds the one value llama32 computes. `check_fields` applies a table to a config.

Why a table: a config field the engines do not read is a silent wrong answer waiting to happen (`hidden_act: gelu`
ran as SiLU, `attention_bias: true` ran without its biases). Listing every field HF defines, with a decision and a
reason, turns "forgot to look" into a reviewable line, and one checker gives every model family the same refusals.
Fields no table names are ignored, as HF itself ignores them (it stores them as attributes nothing reads).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from refimpl.errors import ConfigError, quote

IMPLEMENTED, IGNORED, REFUSED = "implemented", "ignored", "refused"


@dataclass(frozen=True)
class Field:
    decision: str  # IMPLEMENTED, IGNORED or REFUSED
    why: str  # IGNORED: why it cannot change the result; REFUSED: the supported values ("expected <why>")
    accepts: Callable[[object], bool] | None = None  # REFUSED: the values that mean what llama32 computes


def implemented(why: str = "read by the config loader") -> Field:
    return Field(IMPLEMENTED, why)


def ignored(why: str) -> Field:
    return Field(IGNORED, why)


def refused_unless(accepts: Callable[[object], bool], supported: str) -> Field:
    return Field(REFUSED, supported, accepts)


def is_bool(value) -> bool:
    return isinstance(value, bool)


def equals(*values) -> Callable[[object], bool]:
    """Exact value and type: `true` is not 1, "false" is not false."""
    return lambda v: any(type(v) is type(x) and v == x for x in values)


def absent_or(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: v is None or check(v)


def positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_fields(d: dict, table: dict[str, Field], source: str, prefix: str = "") -> None:
    """Raise ConfigError for the first field of `d` whose table entry refuses its value."""
    for name, value in d.items():
        rule = table.get(name)
        if rule is not None and rule.decision == REFUSED and not rule.accepts(value):
            raise ConfigError(f"{source}: {prefix}{name} = {quote(value)} is not supported; expected {rule.why}")


_METADATA = "metadata about the file, not the model's computation"
_HEADS = "selects a task head or output format that a causal LM's next-token logits do not use"
_GENERATION = "a generation default; llama32 takes sampling settings from its command line"

# PretrainedConfig's common fields (transformers 5 configuration_utils.py, plus the 4.x ones still found in files).
PRETRAINED_FIELDS: dict[str, Field] = {
    "transformers_version": ignored(_METADATA),
    "_name_or_path": ignored(_METADATA),
    "name_or_path": ignored(_METADATA),
    "_commit_hash": ignored(_METADATA),
    "_attn_implementation": ignored("chooses HF's attention kernel (eager/sdpa/flash), all the same math"),
    "attn_implementation": ignored("chooses HF's attention kernel (eager/sdpa/flash), all the same math"),
    "architectures": refused_unless(absent_or(lambda v: isinstance(v, list) and "LlamaForCausalLM" in v),
                                    "['LlamaForCausalLM'] or none (a causal LM)"),
    "torch_dtype": ignored("the weights' storage dtype: llama32 reads each tensor's dtype from the file and "
                           "computes in fp32 (refimpl) or --dtype (accel)"),
    "dtype": ignored("the weights' storage dtype: read per tensor from the file; compute dtype is --dtype"),
    "output_hidden_states": ignored(_HEADS), "output_attentions": ignored(_HEADS),
    "return_dict": ignored(_HEADS), "use_return_dict": ignored(_HEADS), "torchscript": ignored(_HEADS),
    "chunk_size_feed_forward": ignored("HF's memory-saving chunking of the MLP: the same values"),
    "is_encoder_decoder": refused_unless(absent_or(equals(False)), "false (a decoder-only model)"),
    "is_decoder": ignored("Llama is a decoder whatever this says; HF's Llama never reads it"),
    "add_cross_attention": refused_unless(absent_or(equals(False)), "false (no cross-attention)"),
    "cross_attention_hidden_size": ignored("only read when add_cross_attention is true, which is refused"),
    "tie_encoder_decoder": ignored("encoder-decoder models only"),
    "id2label": ignored(_HEADS), "label2id": ignored(_HEADS), "num_labels": ignored(_HEADS),
    "problem_type": ignored(_HEADS), "finetuning_task": ignored(_HEADS),
    "tokenizer_class": ignored("the tokenizer is read from tokenizer.json"),
    "prefix": ignored(_GENERATION), "task_specific_params": ignored(_GENERATION),
    "sep_token_id": ignored("a special token for pair inputs; not used in generation"),
    "decoder_start_token_id": ignored("encoder-decoder models only"),
    "pad_token_id": ignored("pads batches; llama32 runs one unpadded sequence"),
    "quantization_config": refused_unless(lambda v: v is None, "none (unquantized weights)"),
    **{k: ignored(_GENERATION) for k in (
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
        "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
        "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
        "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
        "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
        "use_bfloat16", "pruned_heads", "tf_legacy_loss")},
}

# HF's LlamaConfig (transformers/models/llama/configuration_llama.py) on top of the common fields.
LLAMA_FIELDS: dict[str, Field] = {
    **PRETRAINED_FIELDS,
    "model_type": refused_unless(equals("llama"), "'llama'"),
    **{k: implemented() for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
        "bos_token_id", "eos_token_id")},
    "max_position_embeddings": implemented("bounds prompt + new tokens (llama3 rope reads its own original "
                                           "length; HF's default and linear rope do not read it)"),
    "tie_word_embeddings": refused_unless(is_bool, "JSON true or false (a string such as \"false\" "
                                                   "would read as true)"),
    "hidden_act": refused_unless(equals("silu"), "'silu' (the SwiGLU MLP)"),
    "attention_bias": refused_unless(absent_or(equals(False)), "false (no bias on q/k/v/o)"),
    "mlp_bias": refused_unless(absent_or(equals(False)), "false (no bias in the MLP)"),
    "pretraining_tp": ignored("HF 5's forward never reads it; HF 4 only split the same matmuls into slices "
                              "(same result up to rounding)"),
    "attention_dropout": ignored("dropout is applied only while training; inference never drops"),
    "initializer_range": ignored("only initialises new weights; loaded weights replace them"),
    "use_cache": ignored("the KV cache changes the speed, not the values"),
}

# The rope_scaling / rope_parameters object, checked with the same checker.
ROPE_FIELDS: dict[str, Field] = {
    "rope_type": refused_unless(equals("default", "llama3"), "'default' or 'llama3' (linear, dynamic, yarn and "
                                                             "longrope are not implemented)"),
    "type": refused_unless(equals("default", "llama3"), "'default' or 'llama3' (linear, dynamic, yarn and "
                                                        "longrope are not implemented)"),
    "factor": refused_unless(positive_finite, "a finite factor > 0"),
    "low_freq_factor": refused_unless(positive_finite, "a finite number > 0"),
    "high_freq_factor": refused_unless(positive_finite, "a finite number > 0"),
    "original_max_position_embeddings": implemented(),
    "rope_theta": implemented(),
    "partial_rotary_factor": refused_unless(equals(1, 1.0), "1 (rotate the whole head)"),
    **{k: refused_unless(lambda v: v is None, "none (a yarn/longrope parameter)") for k in (
        "attention_factor", "beta_fast", "beta_slow", "short_factor", "long_factor", "mscale", "mscale_all_dim",
        "truncate")},
}

# HF's MllamaConfig (transformers/models/mllama/configuration_mllama.py): the outer config, then its sub-configs.
MLLAMA_FIELDS: dict[str, Field] = {
    **PRETRAINED_FIELDS,
    "architectures": refused_unless(absent_or(lambda v: isinstance(v, list) and "MllamaForConditionalGeneration" in v),
                                    "['MllamaForConditionalGeneration'] or none"),
    "model_type": refused_unless(equals("mllama"), "'mllama'"),
    "text_config": implemented("checked with MLLAMA_TEXT_FIELDS, then read as a Llama decoder"),
    "vision_config": implemented("checked with MLLAMA_VISION_FIELDS"),
    "image_token_index": implemented(), "image_token_id": implemented("transformers 5's name for image_token_index"),
}

MLLAMA_TEXT_FIELDS: dict[str, Field] = {
    **LLAMA_FIELDS,  # the decoder is read by LlamaConfig.from_hf, so every Llama decision holds
    "model_type": refused_unless(equals("mllama_text_model", "llama"), "'mllama_text_model'"),
    "cross_attention_layers": implemented(),
    "head_dim": ignored("HF's Mllama derives it from hidden_size / num_attention_heads and never reads it"),
    "dropout": ignored("dropout is applied only while training"),
}

MLLAMA_VISION_FIELDS: dict[str, Field] = {
    **PRETRAINED_FIELDS,
    "model_type": refused_unless(equals("mllama_vision_model"), "'mllama_vision_model'"),
    **{k: implemented() for k in (
        "hidden_size", "num_hidden_layers", "num_global_layers", "attention_heads", "num_channels",
        "intermediate_size", "vision_output_dim", "image_size", "patch_size", "norm_eps", "max_num_tiles",
        "intermediate_layers_indices", "supported_aspect_ratios")},
    "hidden_act": refused_unless(equals("gelu"), "'gelu' (the vision encoder's exact-erf GELU)"),
    "initializer_range": ignored("only initialises new weights; loaded weights replace them"),
    "attention_dropout": ignored("dropout is applied only while training"),
}
