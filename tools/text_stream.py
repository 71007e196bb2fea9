"""Token ids -> the text shown or sent as they arrive: incremental, with stop strings (llama32 serve's streams,
llama32 generate and chat's printed answers, llama32 batch's stop strings).

A choice's text is re-decoded from all its ids at each step (a token can change how the bytes before it decode),
and only what can no longer change is released: not a trailing incomplete UTF-8 sequence (U+FFFD), not a tail that
could still grow into a stop string. When a stop string appears, the text ends before it (OpenAI's rule: the stop
string is not returned).
"""
from __future__ import annotations


def find_stop(text: str, stops, start: int = 0) -> int | None:
    """Where the earliest of the stop strings starts in `text` (searching from `start`), or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


class TextStream:
    """One choice: `push(ids)` -> the text newly safe to send, `stopped` once a stop string was found."""

    def __init__(self, tokenizer, stops: list[str], stop_ids=()):
        self.tok, self.stops, self.stop_ids = tokenizer, list(stops), set(stop_ids)
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already released
        self.text = ""
        self.stopped = False
        self.tokens_at_stop: int | None = None  # ids generated when the stop string was complete

    def _decode(self) -> str:
        return self.tok.decode([t for t in self.ids if t not in self.stop_ids])

    def push(self, new_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        text = self._decode()
        hit = find_stop(text, self.stops, max(0, self.sent - max((len(s) for s in self.stops), default=0)))
        if hit is not None:
            self.stopped, self.tokens_at_stop = True, len(self.ids)
            self.text = text[:hit]
            return self._release(len(self.text))
        self.text = text
        return self._release(self._safe_end(text))

    def finish(self) -> str:
        """The rest of the text once the choice is over (a held-back tail that never became a stop string)."""
        if not self.stopped:
            self.text = self._decode()
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta

    def _safe_end(self, text: str) -> int:
        end = len(text.rstrip("\ufffd"))  # not a trailing incomplete UTF-8 sequence
        for s in self.stops:
            for k in range(min(len(s) - 1, end), 0, -1):  # the longest tail that is a proper prefix of s
                if text[:end].endswith(s[:k]):
                    end -= k
                    break
        return end


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
