"""Tokenizer and chat prompts: `tokenizers.Tokenizer` from tokenizer.json, chat templates in a Jinja sandbox.

Chat templates come from model files, i.e. from strangers: they are rendered only in the budgeted sandbox of
refimpl.text.template_sandbox, so a template that reaches for Python internals, loops for hours or builds gigabytes
fails with a clear error.
"""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

from refimpl.model.config import LlamaConfig
from refimpl.errors import CheckpointError, GenerationError, quote
from refimpl.formats.jsonfile import MAX_JSON_BYTES, read_json_object
from refimpl.formats.safe_open import read_bytes, stat_path
from refimpl.text.template_sandbox import render, sandbox

# Llama 3's header format, used when a checkpoint ships no chat template.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)


# Byte-level BPE pieces shared by the GGUF tokenizer builder and the toy tokenizers of golden/:
# Llama 3's pre-tokenizer split (tokenizer.json of meta-llama/Llama-3.2-1B), applied before the byte mapping.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in: printable bytes
    stand for themselves, the rest map past 255 (`tokenizers` exports the set of characters, not this map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return table


def llama3_pre_tokenizer():
    """Llama 3's split, then bytes -> printable characters (no second GPT-2 split)."""
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def check_text(text: str, what: str) -> None:
    """Text from the OS (argv, files read with surrogateescape) can hold lone surrogates no tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GenerationError(f"{what} is not valid UTF-8 text (undecodable byte {quote(text[e.start])} at "
                              f"character {e.start})") from None


def _raise_exception(message):
    raise GenerationError(f"chat template: {message}")


class TextTokenizer:
    def __init__(self, tokenizer, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, source: str = "tokenizer"):
        self.tok, self.source = tokenizer, source
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.eos_id = tokenizer.token_to_id(eos_token) if eos_token else None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, model_dir: Path, cfg: LlamaConfig | None = None) -> "TextTokenizer":
        from tokenizers import Tokenizer

        path = model_dir / "tokenizer.json"
        if stat_path(path) is None:
            raise CheckpointError(f"{path}: not found (the model directory needs tokenizer.json)")
        raw = read_bytes(path, "the model directory needs tokenizer.json", limit=MAX_JSON_BYTES)
        try:
            tok = Tokenizer.from_str(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{path}: not a valid tokenizers file (not UTF-8 at byte {e.start})") from None
        except Exception as e:  # the Rust library raises a bare Exception with its parse error
            raise CheckpointError(f"{path}: not a valid tokenizers file ({str(e).splitlines()[0][:200]})") from None
        tcfg = {}
        tcfg_path = model_dir / "tokenizer_config.json"
        if stat_path(tcfg_path) is not None:
            tcfg = read_json_object(tcfg_path, "tokenizer settings and chat_template")
        template, template_file = tcfg.get("chat_template"), tcfg_path
        processor_template = model_dir / "chat_template.json"  # the processor's (vision checkpoints ship one)
        if processor_template.exists():
            template_file = processor_template
            template = read_json_object(processor_template, "the processor's chat_template").get("chat_template")
        jinja = model_dir / "chat_template.jinja"
        if stat_path(jinja) is not None:
            try:
                template = read_bytes(jinja, "a chat template", limit=MAX_JSON_BYTES).decode("utf-8")
            except UnicodeDecodeError as e:
                raise CheckpointError(f"{jinja}: cannot read as UTF-8 text ({e.reason} at byte {e.start})") from None
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if isinstance(t, dict)
                             and t.get("name") == "default"), None)
        if template is not None and not isinstance(template, str):
            raise CheckpointError(f"{template_file}: chat_template must be a string")

        def token_text(key, token_id):
            value = tcfg.get(key)
            if isinstance(value, dict):  # AddedToken serialized as an object
                value = value.get("content")
            if value is None and token_id is not None:
                value = tok.id_to_token(token_id)
            if value is not None and not isinstance(value, str):
                raise CheckpointError(f"{tcfg_path}: {key} must be a string, got {value!r}")
            return value

        bos = token_text("bos_token", cfg.bos_token_id if cfg else None)
        eos = token_text("eos_token", cfg.eos_token_ids[0] if cfg and cfg.eos_token_ids else None)
        return cls(tok, template, bos, eos, source=str(path))

    # ---- text <-> ids ----
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_text(text, "the prompt")
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        if self.bos_id is not None and ids[:2] == [self.bos_id, self.bos_id]:
            ids = ids[1:]  # the text carried a BOS and the post-processor added another
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    # ---- chat ----
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        template = self.chat_template
        if template is None:
            if self.tok.token_to_id("<|start_header_id|>") is None:
                raise CheckpointError(f"{self.source}: no chat template in the checkpoint and no Llama 3 header "
                                      f"tokens to fall back on; run without --chat")
            template = LLAMA3_TEMPLATE
        from jinja2 import TemplateError
        from jinja2.sandbox import SecurityError
        try:
            return render(sandbox(_raise_exception), template,
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                date_string=datetime.now().strftime("%d %b %Y"))
        except SecurityError as e:
            raise CheckpointError(f"{self.source}: chat template tried an unsafe operation and was stopped "
                                  f"({e})") from None
        except TemplateError as e:
            raise CheckpointError(f"{self.source}: chat template failed to render ({e})") from None
        except GenerationError:  # the template's own raise_exception(): already a clear message
            raise
        except Exception as e:  # 1/0, 1e308 ** 2, endless macro recursion: the template's fault, not ours
            raise CheckpointError(f"{self.source}: chat template failed to render "
                                  f"({type(e).__name__}: {e})") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        text = self.render_chat(messages)
        # A template that emits its own BOS must not get a second one from the post-processor.
        has_bos = bool(self.bos_token) and text.startswith(self.bos_token)
        return self.encode(text, add_special_tokens=not has_bos)
