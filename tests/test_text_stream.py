"""tools/text_stream.py, the one path from token ids to streamed text (serve's streams, generate and chat's printed
answers, batch's stop strings): stop strings cut where OpenAI cuts them, a tail that may still become a stop string
or an incomplete UTF-8 sequence is held back, and what is released adds up to the decoded text."""
import io

from tools.text_stream import TextStream, TokenPrinter, find_stop


class Bytes:
    """A byte-level tokenizer: id i is byte i (so one character can take several ids)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def ids(text: str) -> list[int]:
    return list(text.encode())


def test_find_stop_is_the_earliest_of_the_stop_strings():
    assert find_stop("abc STOP x END", ["END", "STOP"]) == 4
    assert find_stop("abc STOP x END", ["END", "STOP"], start=5) == 11
    assert find_stop("abc", ["x"]) is None and find_stop("abc", []) is None


def test_stop_string_cut_and_held_back_tail():
    s = TextStream(Bytes(), ["\n\nUser:"])
    out = [s.push(ids("Hello")), s.push(ids(" there\n")), s.push(ids("\nUs"))]
    assert out == ["Hello", " there", ""]  # "\n" then "\n\nUs" could still grow into the stop string
    assert s.push(ids("er: hi")) == "" and s.stopped and s.text == "Hello there"
    assert s.tokens_at_stop == len(ids("Hello there\n\nUser: hi"))


def test_a_tail_that_never_became_a_stop_string_is_released_at_the_end():
    s = TextStream(Bytes(), ["\n\nUser:"])
    assert s.push(ids("ok\n\nU")) == "ok" and s.finish() == "\n\nU" and not s.stopped


def test_incomplete_utf8_is_held_back_and_printed_whole():
    out = io.StringIO()
    p = TokenPrinter(Bytes(), out)
    seen = []
    for t in ids("née €5"):
        p.push(t)
        seen.append(out.getvalue())
    assert out.getvalue() == "née €5" and p.ids == ids("née €5")
    assert all("\ufffd" not in s for s in seen)
    TokenPrinter(Bytes(), None).push(65)  # no output stream: nothing written, no error
