"""Chat over either engine: when to use chat mode, and a multi-turn session that keeps its history in the KV cache.

A turn renders the whole conversation with the model's chat template (the template decides the exact tokens,
e.g. what follows an assistant message), compares those ids with the ids already in the cache, and prefills only
what differs, at the positions where it belongs; the engines' contract for that is `generate(ids, ..., cache=c,
start=n)` (refimpl/generate.py). Usually the common prefix is the whole earlier conversation, so a turn costs
its own tokens, not the history's; where the template respells an earlier answer (e.g. trims it), the cache is
rewound to the first differing token, so the model always sees exactly what a from-scratch encoding would give.
"""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from refimpl.errors import GenerationError
from refimpl.generate import Sampling

# what instruct checkpoints are called on the Hub and in GGUF file names
_INSTRUCT_NAME = re.compile(r"(instruct|chat|[-_.]it([-_.]|$))", re.I)


def model_name(path: Path) -> str:
    """The name a checkpoint was published under: the file or directory name, or, for a Hugging Face cache
    snapshot (models--org--name/snapshots/<hash>), the repository's."""
    path = Path(path)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.split("--", 2)[-1]
    return path.name


def recorded_names(ckpt) -> list[str]:
    """The names a checkpoint goes by, the ones it records first: config.json's `_name_or_path` (HF's; `quantize`
    and `lora merge` write their source's name there), a GGUF file's general.name / basename / finetune, then the
    name it was published under (model_name)."""
    extra = getattr(ckpt.config, "extra", None) or {}
    recorded = extra.get("_name_or_path")  # a Hub id or a path: its last part is the name
    names = [recorded.rstrip("/").rsplit("/", 1)[-1] if isinstance(recorded, str) else None]
    names += list(extra.get("names") or [])
    return [n for n in names if isinstance(n, str) and n] + [model_name(ckpt.path)]


def source_name(ckpt) -> str:
    """The name a derived checkpoint (quantized, merged) records for its source: one that says instruct if any
    does, so the copy chats by default as its source did, whatever its directory is called."""
    names = recorded_names(ckpt)
    return next((n for n in names if _INSTRUCT_NAME.search(n)), names[0])


def wants_chat(ckpt) -> bool:
    """Chat mode by default for a checkpoint that has a chat template and an instruct-style name among the names
    it records (recorded_names)."""
    tok = ckpt.tokenizer
    return (tok is not None and tok.chat_template is not None
            and any(_INSTRUCT_NAME.search(n) for n in recorded_names(ckpt)))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatSession:
    """One conversation on one engine; `ask` streams the answer's token ids.

    `cached` lists the token ids whose keys and values are in the cache, slot i holding cached[i]."""

    def __init__(self, engine, tokenizer, stop_ids, sampling: Sampling, system: str | None = None,
                 capacity: int | None = None):
        self.engine, self.tok, self.stop_ids, self.sampling = engine, tokenizer, tuple(stop_ids), sampling
        self.capacity = capacity or engine.config.max_position_embeddings
        self.cache = engine.new_cache(self.capacity)
        self.system = system
        self.messages: list[dict] = []
        self.cached: list[int] = []
        self.prefilled: list[int] = []  # tokens prefilled per turn: what a turn cost, for the notice and tests
        self.limit = sampling.max_new_tokens  # the last turn's token limit (less near the end of the context)
        self.dropped = 0  # turns the last message's fit dropped from the start of the conversation
        self.reset()

    def reset(self, system: str | None = ...) -> None:
        """Forget the conversation (the cache is rewound, not reallocated); optionally a new system message."""
        if system is not ...:
            self.system = system
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, text: str) -> Iterator[int]:
        """Add a user message and stream the answer; the answer (as far as it got) joins the history even when
        the caller stops early (Ctrl-C). When the conversation outgrows the context, its oldest turns are dropped
        first (the system message stays): `dropped` counts them, for the caller to say so."""
        messages, ids = self.fit(self.messages + [{"role": "user", "content": text}])
        return self._stream(messages, ids)

    def fit(self, messages: list[dict]) -> tuple[list[dict], list[int]]:
        """The conversation and its ids with as many of its oldest turns dropped as leave the answer room: at least
        min(--max-new-tokens, a quarter of the context) positions, or any at all once only the last message is
        left. Only a last message that alone fills the context is an error (the chat goes on after it)."""
        want = min(self.sampling.max_new_tokens, max(1, self.capacity // 4))
        self.dropped = 0
        ids = self.tok.encode_chat(messages)
        while self.capacity - len(ids) < want:
            shorter = _drop_oldest_turn(messages)
            if shorter is None:
                break
            messages = shorter
            self.dropped += 1
            ids = self.tok.encode_chat(messages)
        if self.capacity - len(ids) <= 0:
            raise GenerationError(f"the message needs {len(ids)} positions, more than the {self.capacity} this "
                                  f"chat holds (--context); send a shorter one")
        return messages, ids

    def _stream(self, messages: list[dict], ids: list[int]) -> Iterator[int]:
        room = self.capacity - len(ids)
        keep = min(common_prefix(self.cached, ids), len(ids) - 1)  # at least one token to prefill: its logits
        new = ids[keep:]
        self.messages = messages
        self.cached = ids[:keep]
        self.prefilled.append(len(new))
        self.limit = min(self.sampling.max_new_tokens, room)
        settings = replace(self.sampling, max_new_tokens=self.limit)
        out: list[int] = []
        try:
            for token in self.engine.generate(new, settings, self.stop_ids, cache=self.cache, start=keep):
                out.append(token)
                yield token
        finally:
            if out:  # the prefill finished, and every yielded token but the last went through the model
                self.cached = ids + out[:-1]
            answer = [t for t in out if t not in self.stop_ids]
            self.messages = messages + [{"role": "assistant", "content": self.tok.decode(answer)}]


def _drop_oldest_turn(messages: list[dict]) -> list[dict] | None:
    """The conversation without its first user message and what answered it (a system message stays), or None
    when the last user message is all there is to drop."""
    head = 1 if messages and messages[0]["role"] == "system" else 0
    users = [i for i in range(head, len(messages)) if messages[i]["role"] == "user"]
    if len(users) < 2:
        return None
    return messages[:head] + messages[users[1]:]


def stop_notice(generated: list[int], stop_ids, limit: int, tokenizer, requested: int | None = None,
                context: str = "the model's context") -> str | None:
    """Why an answer ended, when the text alone would not say: empty at once, or cut at a limit, naming which one:
    --max-new-tokens, or the context when it left less room than `requested` (--max-new-tokens as given)."""
    if generated[:1] and generated[0] in stop_ids:
        name = tokenizer.tok.id_to_token(generated[0])
        return f"the model ended its turn at once ({name}, id {generated[0]}): the answer is empty"
    if len(generated) >= limit and not (generated and generated[-1] in stop_ids):
        if requested is not None and limit < requested:
            return f"stopped at the end of {context} ({limit} new tokens fitted, not --max-new-tokens {requested})"
        return f"stopped at the token limit ({limit} new tokens); raise --max-new-tokens for more"
    return None
