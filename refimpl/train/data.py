"""Chat fine-tuning data: JSONL conversations -> (token ids, labels) through the checkpoint's own chat template.

Each line is one sample, in one of the formats fine-tuning datasets ship in (`record_messages`; docs/finetuning.md):
- `{"messages": [{"role", "content"}, ...]}` (system / user / assistant, multi-turn);
- `{"query": ..., "response": ..., "system"?: ...}`;
- alpaca: `{"instruction": ..., "input"?: ..., "output": ..., "system"?: ...}` (the input follows the instruction
  after a blank line);
- sharegpt: `{"conversations": [{"from": "system" | "human" | "gpt", "value": ...}, ...], "system"?: ...}`;
- math: `{"input": ..., "output": ..., "answer": ...}`: the response is the output, then the line `#### ANSWER`
  (GSM8K's answer line) unless the output already ends with it.
Other field names map onto these with `columns` ({"question": "query", ...}, as SWIFT's --columns).
The last message must be the assistant's: it is what the model learns. Labels follow HF's convention: the token id where the loss applies, IGNORE (-100) elsewhere, aligned with the
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


SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
# the field names a record may use, per format; `columns` maps others onto these
FIELDS = ("messages", "conversations", "query", "response", "system", "instruction", "input", "output", "answer",
          "images")
FORMATS = ("'messages', 'conversations' (sharegpt), 'query'/'response', 'instruction'/'output' (alpaca) or "
           "'input'/'output'/'answer' (math)")


def parse_columns(spec: str | None, option: str = "--columns") -> dict[str, str]:
    """`--columns`: a JSON object {"their name": "our name"} or `their=our,their2=our2` -> the mapping; each
    target must be one of FIELDS."""
    if not spec:
        return {}
    text = spec.strip()
    if text.startswith("{"):
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{option}: not a valid JSON object ({e})") from None
        if not isinstance(mapping, dict):
            raise DataError(f"{option}: expected a JSON object of field names")
    else:
        pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
        if any(len(p) != 2 for p in pairs):
            raise DataError(f"{option}: expected THEIR=OURS pairs separated by commas (or a JSON object), got "
                            f"{spec!r}")
        mapping = {a.strip(): b.strip() for a, b in pairs}
    for src, dst in mapping.items():
        if not isinstance(dst, str) or dst not in FIELDS or not src:
            raise DataError(f"{option}: {src!r} maps to {dst!r}; expected one of {', '.join(FIELDS)}")
    return mapping


def _text(record: dict, field: str, where: str, optional: bool = False) -> str | None:
    value = record.get(field)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} must be a string, got "
                        f"{'nothing' if value is None else type(value).__name__}")
    return value


def _sharegpt(record: dict, where: str) -> list[dict]:
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: field 'conversations' must be a non-empty list of {{'from', 'value'}} objects")
    system = _text(record, "system", where, optional=True)
    messages = [{"role": "system", "content": system}] if system is not None else []
    for i, turn in enumerate(turns):
        role = SHAREGPT_ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        if role is None or not isinstance(turn.get("value"), str):
            raise DataError(f"{where}: field 'conversations', turn {i} must be {{'from': one of "
                            f"{', '.join(SHAREGPT_ROLES)}, 'value': a string}}, got {json.dumps(turn)[:80]}")
        messages.append({"role": role, "content": turn["value"]})
    return messages


def _math_response(output: str, answer: str) -> str:
    line = f"#### {answer.strip()}"
    return output if output.rstrip().endswith(line) else f"{output.rstrip()}\n{line}"


def _format_messages(record: dict, where: str) -> list[dict]:
    """A record in any of the accepted formats -> its message list (validated by record_messages)."""
    system = _text(record, "system", where, optional=True) if "system" in record else None
    head = [{"role": "system", "content": system}] if system is not None else []
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: field 'messages' must be a non-empty list of {{'role', 'content'}} objects")
        return messages
    if "conversations" in record:
        return _sharegpt(record, where)
    if "query" in record and "response" in record:
        return head + [{"role": "user", "content": record["query"]},
                       {"role": "assistant", "content": record["response"]}]
    if "instruction" in record and "output" in record:  # alpaca
        prompt, extra = _text(record, "instruction", where), _text(record, "input", where, optional=True)
        prompt = f"{prompt}\n\n{extra}" if extra and extra.strip() else prompt
        return head + [{"role": "user", "content": prompt},
                       {"role": "assistant", "content": _text(record, "output", where)}]
    if "input" in record and "output" in record and "answer" in record:  # math
        answer = record["answer"]
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str):
            raise DataError(f"{where}: field 'answer' must be a string or a number, got {type(answer).__name__}")
        return head + [{"role": "user", "content": _text(record, "input", where)},
                       {"role": "assistant", "content": _math_response(_text(record, "output", where), answer)}]
    raise DataError(f"{where}: expected the fields of one format: {FORMATS}; got keys {sorted(record)}")


def _renamed(record: dict, columns: dict[str, str], where: str) -> dict:
    out = {k: v for k, v in record.items() if k not in columns}
    for src, dst in columns.items():
        if src in record:
            if dst in out:
                raise DataError(f"{where}: field {src!r} maps to {dst!r} (--columns), which the record also has")
            out[dst] = record[src]
    return out


def record_messages(record, where: str, content_ok=None, columns: dict[str, str] | None = None) -> list[dict]:
    """One JSON record (any format of the module docstring; its fields renamed by `columns` first) -> a
    validated message list whose last message is the assistant's. `content_ok(content, where)` accepts a
    non-string message content (image_data's content parts; it raises on a malformed one); text samples take
    strings only. Errors name `where` (FILE:LINE) and the field."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with {FORMATS}, got {type(record).__name__}")
    if columns:
        record = _renamed(record, columns, where)
    messages = _format_messages(record, where)
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


def read_conversations(path: str | Path, columns: dict[str, str] | None = None) -> list[tuple[int, list[dict]]]:
    """[(line number, messages)] for every non-blank line of a JSONL file; any bad line is a DataError."""
    return [(n, record_messages(record, f"{path}:{n}", columns=columns)) for n, record in read_records(path)]


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


def load_samples(path: str | Path, tokenizer, max_length: int, warn=None, encode_record=None,
                 columns: dict[str, str] | None = None) -> list[Sample]:
    """Every conversation of the file, tokenized. Samples longer than max_length are skipped (not truncated:
    a cut would drop the very end-of-turn token the model must learn), each named through `warn`;
    a file where none fits is an error. `encode_record(record, line) -> Sample` replaces the text path's
    parsing (image_data's, for a vision checkpoint); `columns`: record_messages'."""
    def encode_text(record, line):
        messages = record_messages(record, f"{path}:{line}", columns=columns)
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
