"""`llama32 generate`: stream a completion (or a chat answer) and report its speed."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import click

from refimpl.errors import GenerationError
from refimpl.generate import Sampling

from tools.chat_session import stop_notice, wants_chat
from tools.engines import load_engine, resolve_backend, resolve_model
from tools.text_stream import TokenPrinter
from tools.tp import TP_OPTION, load_tp
from tools.vision_inputs import prompt_inputs
from tools.cli.options import ENGINE_OPTIONS, MODEL_OPTION, QUANT_HELP, UserPath, sampling_options


def read_prompt(prompt: str) -> str:
    """PROMPT as given, or all of stdin for '-'."""
    if prompt != "-":
        return prompt
    text = sys.stdin.read()
    return text[:-1] if text.endswith("\n") else text  # `echo text |` adds one newline that is not the prompt's


def fit_to_context(n_prompt: int, max_new_tokens: int, context: int) -> tuple[int, str | None]:
    """--max-new-tokens, lowered so that prompt + new tokens fit the model's context, and the notice saying so."""
    room = context - n_prompt
    if room <= 0:
        raise GenerationError(f"the prompt ({n_prompt} tokens) fills the model's context of {context} positions; "
                              f"shorten it")
    if max_new_tokens > room:
        return room, (f"--max-new-tokens {max_new_tokens} lowered to {room}: the prompt ({n_prompt} tokens) and the "
                      f"answer must fit the model's context of {context} positions")
    return max_new_tokens, None


def greedy_notice(temperature: float, top_k: int, top_p: float, seed: int | None) -> str | None:
    """The sampling options given that greedy decoding (--temperature 0) does not use, said rather than ignored."""
    unused = [name for name, given in (("--top-k", top_k != 0), ("--top-p", top_p != 1.0),
                                       ("--seed", seed is not None)) if given]
    if temperature != 0 or not unused:
        return None
    return (f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} ignored with --temperature 0 (greedy "
            f"decoding picks the most likely token); give a temperature > 0 to sample")


@click.command()
@click.argument("prompt")
@MODEL_OPTION
@click.option("--chat/--no-chat", default=None,
              help="Wrap the prompt in the model's chat template (default: on for instruct models with a template).")
@click.option("--system", default=None, help="System message for --chat.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@sampling_options("HF's: seen tokens' logits divided by it (multiplied if negative); 1 disables it.")
@ENGINE_OPTIONS
@click.option("--json", "as_json", is_flag=True, help="Print one JSON record instead of streaming text.")
@click.option("--lora", "lora", default=None, type=UserPath(),
              help="PEFT LoRA adapter directory, merged (fp32) into the weights after loading.")
@click.option("--image", "images", multiple=True, type=UserPath(),
              help="An image for a Llama 3.2 Vision checkpoint (repeatable): the prompt's <|image|> tokens take "
                   "the images in order; without any, the images go before the text.")
@click.option("--lora-mode", type=click.Choice(["merged", "unmerged"]), default="merged", show_default=True,
              help="unmerged: keep the base weights and add scale·(x·Aᵀ)·Bᵀ at run time (refimpl backend).")
@click.option("--quant", default=None, metavar="FORMAT",
              help=QUANT_HELP)
@TP_OPTION
def generate(prompt, model, chat, system, max_new_tokens, temperature, top_p, top_k, repetition_penalty, seed,
             backend, device, dtype, as_json, lora=None, images=(), lora_mode="merged", quant=None, tp=1):
    """Generate text from PROMPT ('-' reads it from stdin)."""
    settings = Sampling(max_new_tokens, temperature, top_k, top_p, seed, repetition_penalty)
    if tp > 1:  # stdin read after the load: under torchrun only rank 0 comes back from it
        backend = "accel" if backend == "auto" else backend
        engine, ckpt, load_s = load_tp(resolve_model(model), tp, backend, device, dtype, quant, **{"--lora": lora})
        prompt = read_prompt(prompt)
    else:
        prompt = read_prompt(prompt)
        backend = resolve_backend(backend)
        engine, ckpt, load_s = load_engine(resolve_model(model), backend, device, dtype, lora=lora,
                                           lora_mode=lora_mode, quant=quant)
    tok = ckpt.tokenizer
    notes = []  # on stderr as they come, or in the --json record (stdout stays one JSON line)

    def tell(line: str) -> None:
        notes.append(line)
        if not as_json:
            click.echo(line, err=True)

    greedy = greedy_notice(temperature, top_k, top_p, seed)
    if greedy:
        tell(f"note: {greedy}")
    if chat is None:
        chat = wants_chat(ckpt)
        if chat:
            tell("chat mode: the prompt goes through the model's chat template (--no-chat for raw completion)")
    vision = prompt_inputs(ckpt, prompt, images, chat, system)
    if vision is not None:
        prompt_ids = vision.ids
    elif chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user",
                                                                                   "content": prompt}]
        prompt_ids = tok.encode_chat(messages)
    else:
        if not prompt:
            raise GenerationError("the prompt is empty: give some text to continue")
        prompt_ids = tok.encode(prompt)
    fitted, note = fit_to_context(len(prompt_ids), max_new_tokens, ckpt.config.max_position_embeddings)
    settings = replace(settings, max_new_tokens=fitted)
    if note:
        tell(f"note: {note}")
    stream = TokenPrinter(tok, None if as_json else sys.stdout)
    t0 = time.perf_counter()
    times = []
    inputs = vision.engine_kwargs if vision is not None else {}
    try:
        for token in engine.generate(prompt_ids, settings, stop_ids=ckpt.stop_ids, **inputs):
            times.append(time.perf_counter())
            stream.push(token)
    except KeyboardInterrupt:
        if not as_json:
            sys.stdout.write("\n")  # end the half-printed line, so the shell prompt and the notice start clean
            sys.stdout.flush()
        raise
    notice = stop_notice(stream.ids, ckpt.stop_ids, settings.max_new_tokens, tok, max_new_tokens)
    notes += [f"note: {notice}"] if notice else []
    prefill_s = times[0] - t0
    decode_s = times[-1] - times[0]
    decode_tps = (len(times) - 1) / decode_s if len(times) > 1 and decode_s > 0 else None
    if as_json:
        record = {
            "model": str(ckpt.path), "backend": backend, "quant": quant, "prompt": prompt, "chat": chat,
            "prompt_ids": prompt_ids, "generated_ids": stream.ids, "text": tok.decode(stream.ids),
            "stopped_on_eos": bool(stream.ids) and stream.ids[-1] in ckpt.stop_ids,
            "sampling": settings.__dict__,
            "timings": {"load_s": load_s, "prefill_s": prefill_s, "decode_s": decode_s,
                        "decode_tokens_per_s": decode_tps, "prompt_tokens": len(prompt_ids),
                        "generated_tokens": len(stream.ids)},
            **(vision.record if vision is not None else {}),
            "notes": notes,
        }
        click.echo(json.dumps(record))
        return
    sys.stdout.write("\n")
    if notice:
        click.echo(f"note: {notice}", err=True)
    rate = f"{decode_tps:.1f} tok/s" if decode_tps else "n/a"
    click.echo(f"[{backend}] {len(prompt_ids)} prompt tokens in {prefill_s * 1000:.0f} ms, "
               f"{len(stream.ids)} new tokens, decode {rate} (load {load_s:.1f} s)", err=True)
