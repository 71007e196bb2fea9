"""`llama32 chat`: a multi-turn conversation kept in the KV cache answers exactly as re-encoding the whole
conversation from scratch does (greedy, toy model, both engines), without re-encoding the history; the
scripted CLI handles /reset, /system and /exit; Ctrl-C stops an answer, not the chat."""
import dataclasses
import io

import pytest
from click.testing import CliRunner

from refimpl.formats.checkpoint import load_checkpoint
from refimpl.generate import RefEngine, Sampling
from tools.chat_session import ChatSession, common_prefix
from tools.cli import main
from tools.text_stream import TokenPrinter
from tools.toy import TOYS, ToySpec, write_toy_checkpoint

TURNS = ("the sea", "and the moon?", "tides and the sun")
GREEDY = Sampling(max_new_tokens=6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """toy-gqa with an untied lm_head: the tied toys greedily repeat their last token (the embedding dominates
    the residual stream), so every answer would be the same; this one answers each turn differently."""
    spec = ToySpec("toy-chat", dataclasses.replace(TOYS[0].config, tie_word_embeddings=False), seed=4)
    return write_toy_checkpoint(spec, tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def ckpt(model_dir):
    return load_checkpoint(model_dir)


def from_scratch(ckpt, messages):
    """The oracle: a fresh engine and cache, the whole conversation encoded and prefilled at once."""
    ids = ckpt.tokenizer.encode_chat(messages)
    return list(RefEngine(ckpt).generate(ids, GREEDY, ckpt.stop_ids))


class PrefillSpy:
    """Wraps an engine's prefill entry point and records the positions of every multi-token call."""

    def __init__(self, engine, method):
        self.calls, real = [], getattr(engine, method)

        def spy(ids, *rest):
            if method == "logits":
                positions = list(rest[0])
            else:  # accel: prefill(ids, session, start)
                start = rest[1] if len(rest) > 1 else 0
                positions = list(range(start, start + len(ids)))
            if len(ids) > 1:
                self.calls.append(positions)
            return real(ids, *rest)
        setattr(engine, method, spy)


def run_conversation(ckpt, engine, spy):
    session = ChatSession(engine, ckpt.tokenizer, ckpt.stop_ids, GREEDY, system="be brief", capacity=128)
    history = [{"role": "system", "content": "be brief"}]
    for turn in TURNS:
        history.append({"role": "user", "content": turn})
        full = ckpt.tokenizer.encode_chat(history)
        before = list(session.cached)
        got = list(session.ask(turn))
        assert got == from_scratch(ckpt, history), turn
        # no re-encoding: this turn prefilled only what the cache did not hold, starting after the shared prefix
        keep = common_prefix(before, full)
        assert session.prefilled[-1] == len(full) - keep
        assert spy.calls[-1][0] == keep and spy.calls[-1][-1] == len(full) - 1
        history.append({"role": "assistant", "content": ckpt.tokenizer.decode(
            [t for t in got if t not in ckpt.stop_ids])})
    assert session.messages == history
    # every turn after the first reused the whole earlier conversation but for its last answer's tail
    assert all(calls[0] > 20 for calls in spy.calls[1:])
    return session


def test_refimpl_chat_equals_reencoding_and_prefills_only_the_new_turn(ckpt):
    engine = RefEngine(ckpt)
    run_conversation(ckpt, engine, PrefillSpy(engine, "logits"))


def test_accel_cpu_chat_equals_reencoding(ckpt):
    pytest.importorskip("torch")
    from accel.engine import AccelEngine
    engine = AccelEngine.from_checkpoint(ckpt, device="cpu", dtype="fp32", use_triton=False)
    run_conversation(ckpt, engine, PrefillSpy(engine, "prefill"))


def test_reset_forgets_the_conversation(ckpt):
    session = ChatSession(RefEngine(ckpt), ckpt.tokenizer, ckpt.stop_ids, GREEDY, capacity=128)
    first = list(session.ask(TURNS[0]))
    list(session.ask(TURNS[1]))
    session.reset()
    assert session.messages == [] and list(session.ask(TURNS[0])) == first
    session.reset(system="be brief")
    assert list(session.ask(TURNS[0])) == from_scratch(ckpt, [{"role": "system", "content": "be brief"},
                                                               {"role": "user", "content": TURNS[0]}])


def test_a_message_that_alone_fills_the_context_is_a_clear_error(ckpt):
    session = ChatSession(RefEngine(ckpt), ckpt.tokenizer, ckpt.stop_ids, GREEDY, capacity=20)
    with pytest.raises(Exception, match="more than the 20 this chat holds .--context.; send a shorter one"):
        list(session.ask("the sea " * 10))


def test_a_full_context_drops_the_oldest_turns_and_keeps_the_system_message(ckpt):
    """Turn after turn in a context that holds about two: each answer equals a from-scratch encoding of the
    conversation as kept (system message, then the most recent turns), which fits the context."""
    system = {"role": "system", "content": "be brief"}
    session = ChatSession(RefEngine(ckpt), ckpt.tokenizer, ckpt.stop_ids, GREEDY, system="be brief", capacity=48)
    dropped = 0
    for turn in TURNS * 2:
        got = list(session.ask(turn))
        dropped += session.dropped
        kept = session.messages[:-1]
        assert kept[0] == system and kept[-1] == {"role": "user", "content": turn}
        assert got == from_scratch(ckpt, kept)[:session.limit]
        assert len(ckpt.tokenizer.encode_chat(kept)) + len(got) <= 48
    assert dropped >= 3


def test_chat_cli_goes_on_past_its_context(model_dir):
    r = chat_cli(model_dir, "\n".join(TURNS * 2) + "\n" + "the sea " * 40 + "\n" + TURNS[0] + "\n",
                 "--context", "48", "--system", "be brief")
    assert r.stdout.count("> ") == 8 and r.stdout.endswith("\n")
    assert "oldest turn(s), kept the system message)" in r.stderr
    assert "error: the message needs" in r.stderr  # the one too long for any context; the chat went on
    assert r.stderr.count("error:") == 1


def chat_cli(model_dir, stdin, *args):
    result = CliRunner().invoke(main, ["chat", "--model", str(model_dir), "--max-new-tokens", "6", *args],
                                input=stdin)
    assert result.exit_code == 0, result.output
    return result


def printed(ckpt, ids):
    """What the chat prints for an answer of `ids`: the streamed text, then a newline."""
    out = io.StringIO()
    stream = TokenPrinter(ckpt.tokenizer, out)
    for t in ids:
        stream.push(t)
    return out.getvalue() + "\n"


def test_scripted_chat_cli(ckpt, model_dir):
    user = [{"role": "user", "content": TURNS[0]}]
    first = from_scratch(ckpt, user)
    second = from_scratch(ckpt, user + [{"role": "assistant", "content": ckpt.tokenizer.decode(first)},
                                        {"role": "user", "content": TURNS[1]}])
    system = from_scratch(ckpt, [{"role": "system", "content": "be brief"}] + user)
    assert len({tuple(first), tuple(second), tuple(system)}) == 3  # the toy answers each differently
    r = chat_cli(model_dir, f"{TURNS[0]}\n{TURNS[1]}\n/reset\n{TURNS[0]}\n/system be brief\n{TURNS[0]}\n/nope\n"
                            f"/exit\nnever read\n")
    assert r.stdout == (f"> {TURNS[0]}\n{printed(ckpt, first)}> {TURNS[1]}\n{printed(ckpt, second)}> /reset\n"
                        f"> {TURNS[0]}\n{printed(ckpt, first)}> /system be brief\n> {TURNS[0]}\n"
                        f"{printed(ckpt, system)}> /nope\n> /exit\n")
    assert "(conversation reset)" in r.stderr and "(system message set; new conversation)" in r.stderr
    assert "unknown command /nope" in r.stderr
    assert "note: stopped at the token limit (6 new tokens)" in r.stderr


def test_ctrl_c_stops_the_answer_not_the_chat(monkeypatch, ckpt, model_dir):
    real, calls = TokenPrinter.push, []

    def push(self, token):
        calls.append(token)
        if len(calls) == 3:  # the user presses Ctrl-C while the first answer is being written
            raise KeyboardInterrupt
        real(self, token)
    monkeypatch.setattr(TokenPrinter, "push", push)
    r = chat_cli(model_dir, f"{TURNS[0]}\n{TURNS[1]}\n")
    assert "(stopped)" in r.stderr
    lines = r.stdout.split("\n")
    assert lines[0] == f"> {TURNS[0]}" and f"> {TURNS[1]}" in lines  # the echo starts on a line of its own
    assert len(calls) > 3  # and the second message was answered


def test_the_notice_names_the_limit_that_stopped_the_answer(ckpt):
    from tools.chat_session import stop_notice
    tok, stops = ckpt.tokenizer, ckpt.stop_ids
    cut = [5, 6, 7]  # three tokens, no stop id: cut at a limit of 3
    assert "raise --max-new-tokens" in stop_notice(cut, stops, 3, tok, requested=3)
    by_context = stop_notice(cut, stops, 3, tok, requested=6, context="the chat's context (48 positions, --context)")
    assert "the chat's context (48 positions" in by_context and "raise --max-new-tokens" not in by_context
    assert stop_notice(cut[:2] + [stops[0]], stops, 3, tok, requested=6) is None  # it ended its turn itself
