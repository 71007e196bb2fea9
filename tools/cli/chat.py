"""`llama32 chat`: an interactive multi-turn chat; the conversation stays in the KV cache between turns.

On a terminal it shows a `> ` prompt (with line editing); otherwise it reads one message a line from stdin and
echoes each as `> message`, so a chat can be scripted and tested. Commands: /reset, /system TEXT, /exit.
Ctrl-C stops the answer being written (it keeps what was said so far); Ctrl-D or /exit leaves.
"""
from __future__ import annotations

import sys

import click

from refimpl.errors import GenerationError
from refimpl.generate import Sampling

from tools.chat_session import ChatSession, stop_notice
from tools.cli.generate import greedy_notice
from tools.cli.options import ENGINE_OPTIONS, MODEL_OPTION, sampling_options
from tools.engines import load_engine, resolve_backend, resolve_model
from tools.text_stream import TokenPrinter
from tools.tp import TP_OPTION, load_tp

HELP = "commands: /reset (forget the conversation), /system TEXT (new system message, new conversation), /exit"


def read_messages(interactive: bool):
    """Yield the user's lines; on a terminal, Ctrl-C at the prompt only reminds how to leave."""
    if not interactive:
        for line in sys.stdin:
            line = line.rstrip("\n")
            click.echo(f"> {line}")
            yield line
        return
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    while True:
        try:
            yield input("> ")
        except KeyboardInterrupt:
            click.echo("\n(/exit or Ctrl-D to leave)", err=True)
        except EOFError:
            click.echo()
            return


def answer(session: ChatSession, text: str) -> None:
    """Stream one answer; Ctrl-C stops it, not the chat."""
    stream = TokenPrinter(session.tok, sys.stdout)
    try:
        tokens = session.ask(text)
    except GenerationError as e:  # this message alone fills the context: say so, and the chat goes on
        click.echo(f"error: {e}", err=True)
        return
    if session.dropped:
        click.echo(f"(the conversation outgrew the {session.capacity} positions this chat holds: dropped its "
                   f"{session.dropped} oldest turn(s){', kept the system message' if session.system else ''})",
                   err=True)
    try:
        for token in tokens:
            stream.push(token)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        click.echo("(stopped)", err=True)
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    notice = stop_notice(stream.ids, session.stop_ids, session.limit, session.tok, session.sampling.max_new_tokens,
                         f"the chat's context ({session.capacity} positions, --context)")
    if notice:
        click.echo(f"note: {notice}", err=True)


@click.command()
@MODEL_OPTION
@click.option("--system", default=None, help="System message.")
@click.option("--max-new-tokens", default=512, show_default=True, type=int, help="Per answer.")
@click.option("--context", default=4096, show_default=True, type=int,
              help="Positions the conversation may fill (at most the model's).")
@sampling_options("HF's, over the tokens of the current turn; 1 disables it.")
@ENGINE_OPTIONS
@TP_OPTION
def chat(model, system, max_new_tokens, context, temperature, top_p, top_k, repetition_penalty, seed, backend,
         device, dtype, tp=1):
    """Chat with a model, turn after turn."""
    settings = Sampling(max_new_tokens, temperature, top_k, top_p, seed, repetition_penalty)
    greedy = greedy_notice(temperature, top_k, top_p, seed)
    if greedy:
        click.echo(f"note: {greedy}", err=True)
    if tp > 1:
        backend = "accel" if backend == "auto" else backend
        engine, ckpt, _ = load_tp(resolve_model(model), tp, backend, device, dtype)
    else:
        backend = resolve_backend(backend)
        engine, ckpt, _ = load_engine(resolve_model(model), backend, device, dtype)
    capacity = max(1, min(context, ckpt.config.max_position_embeddings))
    session = ChatSession(engine, ckpt.tokenizer, ckpt.stop_ids, settings, system, capacity)
    ckpt.tokenizer.render_chat([{"role": "user", "content": "hi"}])  # no template: fail now, not at the first turn
    interactive = sys.stdin.isatty()
    if interactive:
        click.echo(f"{ckpt.path.name} on {backend}; {HELP}", err=True)
    for line in read_messages(interactive):
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            session.reset()
            click.echo("(conversation reset)", err=True)
        elif text == "/system" or text.startswith("/system "):
            session.reset(text[len("/system"):].strip() or None)
            click.echo("(system message set; new conversation)" if session.system else
                       "(system message cleared; new conversation)", err=True)
        elif text.startswith("/") and " " not in text:
            click.echo(f"unknown command {text}; {HELP}", err=True)
        else:
            answer(session, text)
