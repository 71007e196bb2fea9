"""tools/text_stream.py, the one path from token ids to streamed text (serve's streams, generate and chat's printed
answers, batch's stop strings): stop strings cut where OpenAI cuts them, a tail that may still become a stop string
or an incomplete UTF-8 sequence is held back, and what is released adds up to the decoded text.

The oracle for the incremental decode is the tokenizer's decode of all the ids at once: after every push, what was
released is exactly that decode without its trailing incomplete character (and, with stop strings, without a tail
that is a proper prefix of one), for the default model's tokenizer on multi-byte text and on random ids."""
import io
import random

import pytest

from tools.text_stream import TextStream, TokenPrinter, find_stop

INCOMPLETE = "\ufffd"
MULTIBYTE = ("Ünïcode café naïve façade — 日本語のテキストと中文 😀🙂👍🏽 👨‍👩‍👧 €5 ½ Ελληνικά Ж ✓\n"
             "emoji after emoji: 🎉🎉🎉, CJK after CJK: 漢字漢字, and e\u0301 (a combining accent).")


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


# ---------------------------------------------------------------- the default model's tokenizer (SmolLM2)

@pytest.fixture(scope="module")
def smollm2(default_model):
    """(its tokenizer, its stop ids), from the GGUF header alone (no weights dequantized)."""
    from refimpl.formats.gguf_check import validate_gguf
    from refimpl.formats.gguf_loader import Metadata, stop_ids_from
    from refimpl.formats.gguf_tokenizer import build_tokenizer
    meta = Metadata(validate_gguf(default_model).fields, str(default_model))
    return build_tokenizer(meta, str(default_model)), stop_ids_from(meta)


def held_for_stops(text: str, stops) -> int:
    """Brute force: the longest tail of `text` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def chunks(ids, rng):
    """`ids` cut into pushes of 1 to 4 ids (serve's engine outputs can carry several new ids)."""
    i = 0
    while i < len(ids):
        n = rng.randint(1, 4)
        yield ids[i:i + n]
        i += n


def check_against_whole_decode(tok, ids, pushes, stops=(), stop_ids=()):
    """Push `pushes`; after each, what was released must be the whole decode so far, less its incomplete tail and
    less a tail that may become a stop string; returns (the stream, how many pushes left text incomplete)."""
    s = TextStream(tok, list(stops), stop_ids)
    released, seen, incomplete = "", [], 0
    for piece in pushes:
        released += s.push(piece)
        seen += piece
        whole = tok.decode([t for t in seen if t not in stop_ids])
        incomplete += whole.endswith(INCOMPLETE)
        cut = find_stop(whole, stops)
        if cut is not None:
            assert s.stopped and released == whole[:cut] == s.text and s.tokens_at_stop == len(seen)
            return s, incomplete
        final = whole.rstrip(INCOMPLETE)
        assert released == final[:len(final) - held_for_stops(final, stops)], len(seen)
    assert not s.stopped
    released += s.finish()
    assert released == s.text == tok.decode([t for t in ids if t not in stop_ids])
    return s, incomplete


def test_multibyte_text_streams_as_the_whole_decode(smollm2):
    tok, stop_ids = smollm2
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    _, incomplete = check_against_whole_decode(tok, ids, [[t] for t in ids])
    assert incomplete >= 5  # emoji and CJK split into tokens mid-character: the held-back path ran
    _, incomplete = check_against_whole_decode(tok, ids, chunks(ids, random.Random(0)))
    assert incomplete >= 1


def test_special_and_stop_ids_inside_the_text(smollm2):
    tok, stop_ids = smollm2
    start = tok.tok.token_to_id("<|im_start|>")
    ids = tok.encode("日本語 and 🙂", add_special_tokens=False)
    ids = ids[:2] + [start, stop_ids[0]] + ids[2:] + [stop_ids[0]]  # between the bytes of a character, too
    assert tok.decode(ids) == "日本語 and 🙂"
    check_against_whole_decode(tok, ids, [[t] for t in ids], stop_ids=stop_ids)


def test_random_ids_stream_as_the_whole_decode(smollm2):
    """Ids drawn at random: lone continuation bytes, invalid sequences, characters cut by special tokens."""
    tok, _ = smollm2
    rng = random.Random(1)
    byte_ids = [i for i in range(tok.vocab_size)
                if len(tok.decode([i]).encode()) <= 3 and INCOMPLETE in tok.decode([i])][:200]
    assert byte_ids  # byte tokens that are not whole characters
    ids = [rng.choice(byte_ids) if rng.random() < 0.5 else rng.randrange(tok.vocab_size) for _ in range(400)]
    check_against_whole_decode(tok, ids, [[t] for t in ids])
    check_against_whole_decode(tok, ids, chunks(ids, rng))


STOPS = [["🙂👍🏽"], ["テキスト"], ["naïve façade —"], ["👨‍👩", "日本語の"], ["NEVER", "e\u0301 (a"], ["€5"],
         ["🎉🎉🎉, CJK after C"]]


@pytest.mark.parametrize("stops", STOPS)
def test_stop_strings_that_straddle_pushes(smollm2, stops):
    tok, _ = smollm2
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    whole = tok.decode(ids)
    cut = find_stop(whole, stops)
    assert cut is not None
    # the push that completes the stop string, found from the whole decodes of every prefix
    needed = next(i for i in range(1, len(ids) + 1) if find_stop(tok.decode(ids[:i]), stops) is not None)
    assert len(tok.decode(ids[:needed - 1])) > cut  # the stop string spans more than one token
    for pushes in ([[t] for t in ids], list(chunks(ids, random.Random(len(stops[0]))))):
        s, _ = check_against_whole_decode(tok, ids, pushes, stops)
        assert s.stopped and s.text == whole[:cut]
        assert s.push(ids[:3]) == "" and s.finish() == "" and s.text == whole[:cut]  # nothing after the stop
    s, _ = check_against_whole_decode(tok, ids, [[t] for t in ids], stops)
    assert s.tokens_at_stop == needed


def test_a_decoder_that_drops_a_leading_space_streams_as_its_whole_decode():
    """SentencePiece-style decoders strip the text's first space: the window keeps the previous token as context,
    so a word's space is kept when it is not the first, also after a token that decodes to nothing."""

    class Pieces:
        vocab = ["▁Hello", "▁wor", "ld", "!", "▁", "▁x", ""]  # 6: a skipped special token

        def decode(self, ids):
            return "".join(self.vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")

    tok = Pieces()
    ids = [0, 1, 2, 3, 6, 5, 6, 6, 1, 4, 4]
    check_against_whole_decode(tok, ids, [[t] for t in ids])
    check_against_whole_decode(tok, ids, [[t] for t in ids], stops=["ld! "])
