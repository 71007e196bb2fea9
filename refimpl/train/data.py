"""Chat fine-tuning data: JSONL conversations -> (token ids, labels) through the checkpoint's own chat template.

Each line is one sample, either `{"messages": [{"role", "content"}, ...]}` (system / user / assistant, multi-turn)
or `{"query": ..., "response": ..., "system"?: ...}`. The last message must be the assistant's: it is what the model
learns. Labels follow HF's convention: the token id where the loss applies, IGNORE (-100) elsewhere, aligned with the
ids (the shift to next-token targets happens in the loss). The trained tokens are those of the full rendering that
follow the rendering of messages[:-1] with the generation prompt: the final assistant turn and its end-of-turn token.

Image samples (`"images": [...]` beside the messages, or {"type": "image"} content parts) are read for a Llama 3.2
Vision checkpoint by refimpl.train.image_data, which reuses this parsing and labelling; a text-only checkpoint
refuses them.

Pure Python (json + the tokenizer): the NumPy refimpl and the torch trainer read data through the same code.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from refimpl.errors import DataError

IGNORE = -100  # HF's ignore_index: positions that contribute nothing to the loss
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Sample:
    line: int  # 1-based line of the JSONL file it came from
    ids: list[int]  # [T]
    labels: list[int]  # [T]: ids where trained, IGNORE elsewhere

    @property
    def n_labels(self) -> int:
        """Tokens this sample contributes to the loss (labels are predicted from the previous position)."""
        return sum(1 for t in self.labels[1:] if t != IGNORE)


def record_messages(record, where: str, content_ok=None) -> list[dict]:
    """One JSON record -> a validated message list whose last message is the assistant's. `content_ok(content,
    where)` accepts a non-string message content (image_data's content parts; it raises on a malformed one);
    text samples take strings only."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with 'messages' or 'query'/'response', "
                        f"got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    elif "query" in record and "response" in record:
        messages = ([{"role": "system", "content": record["system"]}] if record.get("system") is not None else [])
        messages += [{"role": "user", "content": record["query"]},
                     {"role": "assistant", "content": record["response"]}]
    else:
        raise DataError(f"{where}: expected a 'messages' list or 'query' and 'response' fields, "
                        f"got keys {sorted(record)}")
    if "images" in record and content_ok is None:
        raise DataError(f"{where}: image samples ('images') need a Llama 3.2 Vision checkpoint; the base model is "
                        f"text-only")
    for i, m in enumerate(messages):
        ok = isinstance(m, dict) and m.get("role") in ROLES
        if ok and not isinstance(m.get("content"), str):
            ok = content_ok is not None and content_ok(m.get("content"), f"{where}: message {i}")
        if not ok:
            raise DataError(f"{where}: message {i} must be {{'role': one of {', '.join(ROLES)}, "
                            f"'content': a string}}, got {json.dumps(m)[:80]}")
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: the conversation has no final assistant turn to learn (last role is "
                        f"{messages[-1]['role']!r})")
    return messages


def read_conversations(path: str | Path) -> list[tuple[int, list[dict]]]:
    """[(line number, messages)] for every non-blank line of a JSONL file; any bad line is a DataError."""
    return [(n, record_messages(record, f"{path}:{n}")) for n, record in read_records(path)]


def read_records(path: str | Path) -> list[tuple[int, object]]:
    """[(line number, parsed JSON)] for every non-blank line of a JSONL file; unreadable files and lines are a
    DataError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file (expected a JSONL file of conversations)") from None
    except (UnicodeDecodeError, OSError) as e:
        raise DataError(f"{path}: cannot read as UTF-8 text ({e})") from None
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e})") from None
        out.append((n, record))
    if not out:
        raise DataError(f"{path}: holds no samples")
    return out


def encode_conversation(tokenizer, messages: list[dict], where: str = "sample",
                        encode=None) -> tuple[list[int], list[int]]:
    """(ids [T], labels [T]): ids of the full rendering; labels keep the part after the prompt's rendering.

    Tokenized as HF's apply_chat_template does: the rendered text alone, no special tokens added (a template that
    wants <|begin_of_text|> emits it itself); `encode(text) -> ids` replaces that (a vision processor's rules)."""
    encode = encode or (lambda text: tokenizer.encode(text, False))
    prompt = encode(tokenizer.render_chat(messages[:-1], add_generation_prompt=True))
    ids = encode(tokenizer.render_chat(messages, add_generation_prompt=False))
    if ids[:len(prompt)] != prompt or len(ids) == len(prompt):
        # a template whose prompt rendering is not a prefix of the full one (e.g. it strips reasoning from earlier
        # turns) has no well-defined "assistant tokens"; refusing beats training on the wrong span
        raise DataError(f"{where}: the chat template's rendering of the conversation without its last turn "
                        f"(plus the generation prompt) is not a prefix of the full rendering")
    return ids, [IGNORE] * len(prompt) + ids[len(prompt):]


def load_samples(path: str | Path, tokenizer, max_length: int, warn=None, encode_record=None) -> list[Sample]:
    """Every conversation of the file, tokenized. Samples longer than max_length are skipped (not truncated:
    a cut would drop the very end-of-turn token the model must learn), each named through `warn`;
    a file where none fits is an error. `encode_record(record, line) -> Sample` replaces the text path's
    parsing (image_data's, for a vision checkpoint)."""
    def encode_text(record, line):
        messages = record_messages(record, f"{path}:{line}")
        return Sample(line, *encode_conversation(tokenizer, messages, f"{path}:{line}"))

    samples, skipped = [], []
    for line, record in read_records(path):
        sample = (encode_record or encode_text)(record, line)
        if len(sample.ids) > max_length:
            skipped.append((line, len(sample.ids)))
            continue
        samples.append(sample)
    if skipped and warn is not None:
        lines = ", ".join(f"{n} ({t} tokens)" for n, t in skipped[:5]) + (" ..." if len(skipped) > 5 else "")
        warn(f"{path}: skipped {len(skipped)} sample(s) longer than --max-length {max_length}: line {lines}")
    if not samples:
        line, t = skipped[0]
        raise DataError(f"{path}:{line}: sample of {t} tokens is longer than --max-length {max_length}, and so is "
                        f"every other sample (they are skipped, not truncated); raise --max-length")
    return samples
