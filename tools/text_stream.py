"""Token ids -> the text shown or sent as they arrive: incremental, with stop strings (llama32 serve's streams,
llama32 generate and chat's printed answers, llama32 batch's stop strings).

A step decodes only a short window of ids, as vLLM's incremental detokenizer does: ids[prefix:] is decoded and
the text of ids[prefix:read], returned before, cut off its front; those ids are there as context, for a tokenizer
that decodes a word differently at the start of a text. Both offsets move on once the window ends in a whole
character; until then its complete characters are returned and a trailing incomplete UTF-8 sequence (U+FFFD)
waits. The offsets only ever sit where the text decoded so far ends in a whole character, so the pieces add up to
the decode of all the ids at once. A step costs O(window + longest stop string), not O(text): a choice of n tokens
costs O(n) in all, not O(n^2) (the window: the ids of the last piece returned and those since, a few; only ids
that never complete a character, invalid bytes one after another, keep it growing).

Only what can no longer change is released: not an incomplete character, not a tail that could still grow into a
stop string. A stop string therefore never starts in released text, and is searched for only in what is held.
When one appears, the text ends before it (OpenAI's rule: the stop string is not returned).
"""
from __future__ import annotations

INCOMPLETE = "\ufffd"  # what a decoder gives for bytes that are not (yet) a whole UTF-8 character


def find_stop(text: str, stops, start: int = 0) -> int | None:
    """Where the earliest of the stop strings starts in `text` (searching from `start`), or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


def stop_prefix_len(text: str, stops) -> int:
    """The length of the longest tail of `text` that is a proper prefix of one of the stop strings."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


class Detokenizer:
    """Ids in, final text out: `push(ids)` -> the characters those ids completed (the decode of every id pushed so
    far, piece by piece); `flush()` -> what is left, a trailing incomplete sequence included."""

    def __init__(self, tokenizer, skip_ids=()):
        self.tok, self.skip_ids = tokenizer, set(skip_ids)
        self.ids: list[int] = []  # every id not skipped
        self.prefix = self.read = 0  # window = ids[prefix:]; ids[prefix:read] decode to prefix_text
        self.prefix_text = ""
        self.done = 0  # characters past prefix_text already returned from a window that ended mid-character

    def _tail(self) -> str:
        """The window's text past what ids[prefix:read] decode to."""
        return self.tok.decode(self.ids[self.prefix:])[len(self.prefix_text):]

    def push(self, new_ids) -> str:
        self.ids.extend(t for t in new_ids if t not in self.skip_ids)
        tail = self._tail()
        if not tail or tail.endswith(INCOMPLETE):
            whole = tail.rstrip(INCOMPLETE)
            piece, self.done = whole[self.done:], max(self.done, len(whole))
            return piece
        piece = tail[self.done:]
        self.prefix, self.read, self.done = self.read, len(self.ids), 0
        self.prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        return piece

    def flush(self) -> str:
        tail = self._tail()
        piece, self.done = tail[self.done:], max(self.done, len(tail))
        return piece


class TextStream:
    """One choice: `push(ids)` -> the text newly safe to send, `stopped` once a stop string was found, `text` the
    text so far (up to the stop string once stopped)."""

    def __init__(self, tokenizer, stops: list[str], stop_ids=()):
        self.stops = list(stops)
        self.detok = Detokenizer(tokenizer, stop_ids)
        self.ids: list[int] = []  # every id pushed, stop ids included
        self.sent: list[str] = []  # the pieces released
        self.held = ""  # final text not released yet: a tail that may still become a stop string
        self.stopped = False
        self.tokens_at_stop: int | None = None  # ids generated when the stop string was complete

    @property
    def text(self) -> str:
        return "".join(self.sent) + self.held

    def push(self, new_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        self.held += self.detok.push(new_ids)
        hit = find_stop(self.held, self.stops)
        if hit is not None:
            self.stopped, self.tokens_at_stop = True, len(self.ids)
            self.held = self.held[:hit]
            return self._release(len(self.held))
        return self._release(len(self.held) - stop_prefix_len(self.held, self.stops))

    def finish(self) -> str:
        """The rest of the text once the choice is over (a held-back tail that never became a stop string)."""
        if not self.stopped:
            self.held += self.detok.flush()
        return self._release(len(self.held))

    def _release(self, end: int) -> str:
        delta, self.held = self.held[:end], self.held[end:]
        if delta:
            self.sent.append(delta)
        return delta


class TokenPrinter:
    """A completion's text written to `out` (None: nowhere) as its tokens arrive, one TextStream without stop
    strings: an incomplete UTF-8 sequence at the end (U+FFFD) is held back until its bytes are complete."""

    def __init__(self, tokenizer, out):
        self.stream, self.out = TextStream(tokenizer, []), out

    @property
    def ids(self) -> list[int]:
        return self.stream.ids

    def push(self, token: int) -> None:
        delta = self.stream.push([token])
        if self.out is not None and delta:
            self.out.write(delta)
            self.out.flush()
