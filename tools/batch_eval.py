"""`llama32 batch --eval`: how close each generated text is to its reference answer.

- exact match of the final answer after normalisation. The final answer is the last \\boxed{...}, else what follows
  the last "####" (GSM8K's mark), else what follows the last "answer is" / "answer:", else the whole text. A
  numeric reference compares numbers: the last number of the final answer, commas, units and $ dropped
  ("$1,234.50 dollars" == "1234.5"). Any other reference compares normalised strings (case, surrounding
  whitespace and punctuation, repeated spaces, $...$ delimiters).
- normalised edit distance, for LaTeX-like references (a backslash, ^, _ or braces): Levenshtein distance between
  the texts with whitespace and $ delimiters removed, over the longer one's length (0 = identical, 1 = nothing
  shared), as OCR benchmarks of printed formulas report it.
- mean loss (nats a token) and perplexity of the reference answer under the model, teacher-forced: one forward
  over prompt + answer tokens, the answer's tokens scored by the logits one position before each.
"""
from __future__ import annotations

import math
import re

import numpy as np

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_LATEX = re.compile(r"[\\^_{}]")
_ANSWER_IS = re.compile(r"(?:answer is|answer:)\s*", re.I)


def last_number(text: str) -> float | None:
    """The last number in `text` (commas inside it dropped), or None."""
    found = _NUMBER.findall(text.replace("$", ""))
    for raw in reversed(found):
        try:
            return float(raw.replace(",", ""))
        except ValueError:  # "1,," and the like
            continue
    return None


def _boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...}, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def final_answer(text: str) -> str:
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1]
    for mark in reversed(list(_ANSWER_IS.finditer(text))):  # "the answer is:" with nothing after it: not this one
        if normalise(text[mark.end():]):
            return text[mark.end():]
    return text


def normalise(text: str) -> str:
    text = text.strip().strip("$").strip()
    text = re.sub(r"\s+", " ", text.lower())
    return text.strip(" .,;:!?\"'")


def is_numeric(answer: str) -> bool:
    """A reference that is a number (perhaps with $, commas or a unit word): compared as numbers."""
    core = re.sub(r"[a-z%]+\.?$", "", normalise(answer.replace("$", "")).replace(",", "")).strip()
    return bool(re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", core))


def exact_match(text: str, answer: str) -> bool:
    if "####" in answer:  # a GSM8K reference keeps its worked solution before the mark
        answer = answer.rsplit("####", 1)[1]
    got = final_answer(text)
    if is_numeric(answer):
        want, have = last_number(answer), last_number(got)
        return have is not None and math.isclose(have, want, rel_tol=0, abs_tol=1e-9)
    return normalise(got) == normalise(final_answer(answer))


def is_latex(answer: str) -> bool:
    return bool(_LATEX.search(answer))


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions each cost 1), O(len(a)·len(b)) time."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def _latex_text(text: str) -> str:
    return re.sub(r"\s+", "", text.strip().strip("$"))


def normalised_edit_distance(text: str, answer: str) -> float:
    a, b = _latex_text(text), _latex_text(answer)
    return edit_distance(a, b) / max(len(a), len(b), 1)


def answer_loss(logits: np.ndarray, answer_ids: list[int]) -> float:
    """logits [T, V] of prompt + answer (T = P + A) -> mean negative log-likelihood of the A answer tokens, each
    scored by the logits of the position before it (rows P-1 .. T-2)."""
    a = len(answer_ids)
    rows = logits[-a - 1:-1].astype(np.float64)  # [A, V]
    top = rows.max(axis=1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))  # [A]
    return float(np.mean(log_z - rows[np.arange(a), answer_ids]))


def text_metrics(text: str, answer: str) -> dict:
    out = {"exact_match": exact_match(text, answer)}
    if is_latex(answer):
        out["edit_distance"] = normalised_edit_distance(text, answer)
    return out


def summarize(metrics: list[dict]) -> dict:
    """Per-request metrics -> the run's: accuracy, mean edit distance (LaTeX answers), token-weighted mean loss
    and its perplexity."""
    n = len(metrics)
    out = {"evaluated": n, "exact_match": sum(m["exact_match"] for m in metrics) / n if n else None}
    edits = [m["edit_distance"] for m in metrics if "edit_distance" in m]
    out["edit_distance"] = sum(edits) / len(edits) if edits else None
    out["edit_distance_requests"] = len(edits)
    scored = [m for m in metrics if m.get("loss") is not None]
    tokens = sum(m["answer_tokens"] for m in scored)
    out["loss"] = sum(m["loss"] * m["answer_tokens"] for m in scored) / tokens if tokens else None
    out["perplexity"] = math.exp(out["loss"]) if out["loss"] is not None else None
    out["answer_tokens"] = tokens
    return out


def render_summary(s: dict) -> str:
    parts = [f"eval: {s['evaluated']} requests", f"exact match {100 * s['exact_match']:.1f}%"
             if s["exact_match"] is not None else "exact match -"]
    if s["edit_distance"] is not None:
        parts.append(f"edit distance {s['edit_distance']:.3f} ({s['edit_distance_requests']} LaTeX answers)")
    if s["loss"] is not None:
        parts.append(f"answer loss {s['loss']:.4f} (perplexity {s['perplexity']:.2f}, {s['answer_tokens']} tokens)")
    return ", ".join(parts)
