"""`llama32 batch`'s input and output files: every request line checked (and tokenized) before any work starts.

An input line is one JSON object:
    {"id": str, "prompt": str}             raw completion (the tokenizer adds <|begin_of_text|>)
    {"id": str, "messages": [{role, content}, ...]}   the model's chat template, ending in the assistant's turn
optional: "images" (list of paths relative to the input file, for a Llama 3.2 Vision checkpoint, whose prompts
tools/vision_requests.py builds), "adapter" (a --lora NAME), "max_tokens", "temperature", "top_p", "top_k", "seed",
"stop" (a string or a list of strings), and "answer" (the reference, for --eval). Blank lines are skipped.

An output line: {"id", "text", "generated_ids", "finish_reason", "usage": {"prompt_tokens", "completion_tokens"}}
(and "eval" with --eval). Output files are written in input order, so a file cut short by a crash holds a prefix of
the run's requests; a resumed run skips the ids already in it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from refimpl.errors import GenerationError, Llama32Error, quote
from refimpl.generate import sampling_problem

KNOWN_FIELDS = ("id", "prompt", "messages", "images", "adapter", "max_tokens", "temperature", "top_p", "top_k",
                "seed", "stop", "answer")
ROLES = ("system", "user", "assistant", "tool", "ipython")


@dataclass
class Request:
    """One input line, checked: `sampling` holds SamplingParams' fields (max_tokens after fitting the context)."""

    id: str
    line: int  # 1-based line number in the input file
    prompt_ids: list[int]
    sampling: dict
    stop: tuple[str, ...] = ()
    adapter: str | None = None
    images: tuple[str, ...] = ()
    answer: str | None = None
    notes: list[str] = field(default_factory=list)
    image_inputs: object = None  # a vision model's refimpl.vision.inputs.ImageInputs, None without images


class LineError(GenerationError):
    pass


def _where(path: Path, line: int) -> str:
    return f"{path}:{line}"


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise LineError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise LineError(f"{where}: messages[{i}] must be an object with string \"role\" and \"content\", got "
                            f"{quote(m)}")
        if m["role"] not in ROLES:
            raise LineError(f"{where}: messages[{i}] has role {quote(m['role'])}, expected one of {', '.join(ROLES)}")


def _check_sampling(obj: dict, where: str, default_max_tokens: int) -> dict:
    """The line's sampling fields -> SamplingParams keyword arguments (refimpl.generate.sampling_problem's rules)."""
    out = {"max_tokens": default_max_tokens, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None}
    out.update((k, obj[k]) for k in out if k in obj)
    problem = sampling_problem(**out, seed_bits=63)
    if problem is not None:
        name, want, value = problem
        raise LineError(f"{where}: \"{name}\" must be {want}, got {quote(value)}")
    return {**out, "temperature": float(out["temperature"]), "top_p": float(out["top_p"])}


def _check_stop(value, where: str) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise LineError(f"{where}: \"stop\" must be a non-empty string or a list of them, got {quote(value)}")
    return tuple(stops)


def _check_images(value, where: str, vision) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise LineError(f"{where}: \"images\" must be a list of image paths, got {quote(value)}")
    if value and not vision:
        raise LineError(f"{where}: \"images\" given, but the model is text-only (images need a Llama 3.2 Vision "
                        f"checkpoint)")
    return tuple(value)


def _prompt_ids(obj: dict, where: str, tokenizer, vision, images: tuple[str, ...]):
    """-> (prompt ids, a vision model's ImageInputs or None)."""
    if ("prompt" in obj) == ("messages" in obj):
        raise LineError(f"{where}: give exactly one of \"prompt\" (raw completion) or \"messages\" (chat)")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise LineError(f"{where}: \"prompt\" must be a non-empty string, got {quote(obj['prompt'])}")
    else:
        _check_messages(obj["messages"], where)
    if vision:
        return vision.build(obj, images)
    return (tokenizer.encode(obj["prompt"]) if "prompt" in obj else tokenizer.encode_chat(obj["messages"])), None


def parse_line(obj, where: str, tokenizer, context: int, default_max_tokens: int, adapters, vision,
               need_answer: bool) -> Request:
    """One decoded JSON line -> a Request, or LineError naming `where` (FILE:LINE) and what was expected. vision:
    a Llama 3.2 Vision checkpoint's tools.vision_requests.VisionPrompts, None (or False) for a text model."""
    if not isinstance(obj, dict):
        raise LineError(f"{where}: expected a JSON object, got {quote(obj)}")
    unknown = [k for k in obj if k not in KNOWN_FIELDS]
    if unknown:
        raise LineError(f"{where}: unknown field {quote(unknown[0])} (expected {', '.join(KNOWN_FIELDS)})")
    if not isinstance(obj.get("id"), str) or not obj["id"]:
        raise LineError(f"{where}: \"id\" must be a non-empty string, got {quote(obj.get('id'))}")
    adapter = obj.get("adapter")
    if adapter is not None and (not isinstance(adapter, str) or adapter not in adapters):
        known = ", ".join(adapters) if adapters else "none given"
        raise LineError(f"{where}: unknown adapter {quote(adapter)} (--lora NAME=DIR names: {known})")
    if need_answer and not isinstance(obj.get("answer"), str):
        raise LineError(f"{where}: --eval needs a string \"answer\", got {quote(obj.get('answer'))}")
    if "answer" in obj and not isinstance(obj["answer"], str):
        raise LineError(f"{where}: \"answer\" must be a string, got {quote(obj['answer'])}")
    images = _check_images(obj["images"], where, vision) if "images" in obj else ()
    stop = _check_stop(obj["stop"], where) if "stop" in obj else ()
    sampling = _check_sampling(obj, where, default_max_tokens)
    try:
        ids, image_inputs = _prompt_ids(obj, where, tokenizer, vision, images)
    except LineError:
        raise
    except Llama32Error as e:  # the tokenizer's, the chat template's or the image reader's own message
        raise LineError(f"{where}: {e}") from None
    room = context - len(ids)
    if room <= 0:
        raise LineError(f"{where}: the prompt ({len(ids)} tokens) fills the model's context of {context} positions")
    notes = []
    if sampling["max_tokens"] > room:
        notes.append(f"{where}: max_tokens {sampling['max_tokens']} lowered to {room} to fit the context")
        sampling["max_tokens"] = room
    return Request(obj["id"], int(where.rsplit(":", 1)[1]), ids, sampling, stop, adapter, images,
                   obj.get("answer"), notes, image_inputs)


def read_requests(path: Path, tokenizer, context: int, default_max_tokens: int = 256, adapters=(),
                  vision=None, need_answer: bool = False) -> list[Request]:
    """Every line of the input file checked; the first bad one raises LineError naming FILE:LINE."""
    requests, seen = [], {}
    for n, raw in enumerate(Path(path).read_bytes().splitlines(), 1):  # \n, \r\n or \r, as text mode reads
        where = _where(path, n)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LineError(f"{where}: not valid UTF-8 (byte {e.start + 1} of the line)") from None
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise LineError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        req = parse_line(obj, where, tokenizer, context, default_max_tokens, adapters, vision, need_answer)
        if req.id in seen:
            raise LineError(f"{where}: duplicate id {quote(req.id)} (first on line {seen[req.id]})")
        seen[req.id] = n
        requests.append(req)
    if not requests:
        raise GenerationError(f"{path}: holds no requests")
    return requests


def read_done(path: Path, known_ids) -> dict[str, dict]:
    """An existing output file's records by id (a resumed run skips them). A last line cut short by a crash is
    dropped from the file; any other bad line, or an id not in the input, is an error naming FILE:LINE."""
    if not path.exists():
        return {}
    done = {}
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    keep = len(raw)
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
                raise ValueError("no string \"id\"")
        except (ValueError, UnicodeDecodeError) as e:
            if n == len(lines):  # no newline after it: the write was interrupted
                keep = len(raw) - len(line)
                break
            raise GenerationError(f"{path}:{n}: not an output record ({e}); move the file away to start over")
        if rec["id"] not in known_ids:
            raise GenerationError(f"{path}:{n}: id {quote(rec['id'])} is not in the input file (an output of "
                                  f"another input? move it away to start over)")
        done[rec["id"]] = rec
    if keep < len(raw):
        with open(path, "r+b") as f:
            f.truncate(keep)
    return done
