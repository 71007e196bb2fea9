"""A GGUF file's tokenizer.ggml.* metadata -> a `tokenizers` byte-level BPE inside refimpl's TextTokenizer, spelled
and split as transformers' GGUF converter does."""
from __future__ import annotations

import sys

from refimpl.errors import CheckpointError

_GPT2_PRE = (None, "default", "gpt2", "gpt-2")
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4  # llama.cpp's token_type codes


def _byte_level_spelling(token: str, alphabet: set, to_unicode: dict) -> str:
    """Vocabularies store tokens in GPT-2's byte alphabet; a token written as raw UTF-8 is respelled, as
    transformers' GGUF converter does, so merges and text meet in one spelling."""
    return token if set(token) <= alphabet else "".join(to_unicode[b] for b in token.encode("utf-8"))


def build_tokenizer(meta, source: str):
    """tokenizer.ggml.* of `meta` (refimpl.formats.gguf_loader.Metadata) -> refimpl.text.tokenizer.TextTokenizer over
    a `tokenizers` byte-level BPE."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    from refimpl.text.tokenizer import TextTokenizer, gpt2_bytes_to_unicode, llama3_pre_tokenizer
    model = meta.get("tokenizer.ggml.model", "str")
    if model != "gpt2":
        raise CheckpointError(f"{source}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2', as in "
                              f"Llama 3 and SmolLM2) is supported, use the HF model directory instead")
    tokens = meta.get("tokenizer.ggml.tokens", "str[]")
    merges = meta.get("tokenizer.ggml.merges", "str[]")
    types = meta.get("tokenizer.ggml.token_type", "int[]", [1] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} "
                              f"tokens")
    to_unicode = gpt2_bytes_to_unicode()
    alphabet = set(to_unicode.values())
    vocab = {_byte_level_spelling(t, alphabet, to_unicode): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise CheckpointError(f"{source}: tokenizer.ggml.merges entries must be two tokens separated by a space")
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False))
    except Exception as e:  # the Rust library raises a bare Exception, e.g. a merge naming an unknown token
        raise CheckpointError(f"{source}: tokenizer.ggml.merges/tokens do not form a BPE vocabulary "
                              f"({str(e).splitlines()[0][:200]})") from None
    pre = meta.get("tokenizer.ggml.pre", "str", None)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's split regex
    if pre in ("llama3", "llama-v3", "llama-bpe"):
        tok.pre_tokenizer = llama3_pre_tokenizer()
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        if pre not in _GPT2_PRE:
            print(f"warning: {source}: pre-tokenizer {pre!r} is not known here; splitting text as GPT-2 does",
                  file=sys.stderr)
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|eot_id|>) stay whole and are skipped when decoding; a control token
    # spelled outside the byte alphabet is a converter mislabel transformers skips too.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                            if ty == TOKEN_CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
                    if ty == TOKEN_USER_DEFINED and t in vocab])

    def token_at(key):
        i = meta.get(key, "int", None)
        if i is not None and not 0 <= i < len(tokens):
            raise CheckpointError(f"{source}: {key} is {i}, outside the {len(tokens)}-token vocabulary")
        return None if i is None else tokens[i]

    bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", "bool", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, vocab[bos])])
    template = meta.get("tokenizer.chat_template", "str", None)
    return TextTokenizer(tok, template, bos, eos, source=source)
