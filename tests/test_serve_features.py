"""`llama32 serve`'s logprobs, presence / frequency penalties and adapters by name, through the official `openai`
client (CPU, toy checkpoint): logprobs against HF transformers' log-softmax, adapters against
`llama32 generate --lora DIR --json` (the refimpl engine over the merged adapter)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from tests._peft_adapters import make_adapters
from tests._serve_helpers import TOY, LiveServer
from tools.cli import main

pytest.importorskip("fastapi")
pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return make_adapters(TOY, tmp_path_factory.mktemp("adapters"), {"math": ["q_proj", "v_proj"],
                                                                     "ocr": ["o_proj", "down_proj"]})


@pytest.fixture(scope="module")
def server(adapters):
    s = LiveServer(adapters=adapters)
    yield s
    s.close()


def generate_json(prompt: str, max_new_tokens: int, *extra) -> dict:
    r = CliRunner().invoke(main, ["generate", "--model", str(TOY), "--backend", "refimpl", "--max-new-tokens",
                                  str(max_new_tokens), "--json", "--no-chat", *map(str, extra), prompt])
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


def hf_log_softmax(prompt_ids, generated):
    model = transformers.LlamaForCausalLM.from_pretrained(TOY, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for i in range(len(generated)):
            z = model(torch.tensor([prompt_ids + generated[:i]])).logits[0, -1].double()
            out.append(torch.log_softmax(z, -1).numpy())
    return out


def test_models_list_the_adapters(server):
    cards = {m.id: m for m in server.client().models.list().data}
    assert set(cards) == {"toy-gqa", "math", "ocr"} and cards["math"].parent == "toy-gqa"


def test_adapters_by_name_equal_generate_lora(server, adapters):
    c = server.client()
    got = {name: c.completions.create(model=name, prompt="the cat sat on", max_tokens=8, temperature=0).choices[0].text
           for name in ("toy-gqa", "math", "ocr")}
    for name in ("math", "ocr"):
        assert got[name] == generate_json("the cat sat on", 8, "--lora", adapters[name])["text"], name
    assert got["toy-gqa"] == generate_json("the cat sat on", 8)["text"]
    assert len(set(got.values())) == 3  # the adapters change the answer


def test_completion_logprobs_are_the_models_log_softmax(server):
    want = generate_json("the cat", 5)
    r = server.client().completions.create(model=server.name, prompt="the cat", max_tokens=5, temperature=0,
                                           logprobs=2)
    lp = r.choices[0].logprobs
    ref = hf_log_softmax(want["prompt_ids"], want["generated_ids"])
    assert len(lp.token_logprobs) == len(want["generated_ids"]) == 5
    for step, (value, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs)):
        assert value == pytest.approx(ref[step][want["generated_ids"][step]], abs=1e-4)
        assert len(top) <= 2 and max(top.values()) == pytest.approx(ref[step].max(), abs=1e-4)


def test_chat_logprobs_stream_equals_non_stream(server):
    c = server.client()
    kw = dict(model=server.name, messages=[{"role": "user", "content": "the sea"}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=3)
    whole = c.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [item for ch in c.chat.completions.create(**kw, stream=True) if ch.choices and ch.choices[0].logprobs
                for item in ch.choices[0].logprobs.content]
    assert [(x.token, round(x.logprob, 6)) for x in whole] == [(x.token, round(x.logprob, 6)) for x in streamed]
    assert len(whole) == 6 and all(len(x.top_logprobs) == 3 for x in whole)
    assert all(x.logprob <= 0 and x.top_logprobs[0].logprob >= x.logprob - 1e-6 for x in whole)


def test_penalties_change_the_answer_as_openai_defines_them(server):
    want = generate_json("the", 1)
    model = transformers.LlamaForCausalLM.from_pretrained(TOY, torch_dtype=torch.float32).eval()
    ids, gen = list(want["prompt_ids"]), []
    for _ in range(10):
        with torch.no_grad():
            z = model(torch.tensor([ids])).logits[0, -1].double().numpy()
        for t in set(gen):
            z[t] -= 0.5 + 1.5 * gen.count(t)
        gen.append(int(np.argmax(z)))
        ids.append(gen[-1])
    from refimpl.formats.checkpoint import load_checkpoint
    text = load_checkpoint(TOY).tokenizer.decode(gen)
    r = server.client().completions.create(model=server.name, prompt="the", max_tokens=10, temperature=0,
                                           presence_penalty=0.5, frequency_penalty=1.5)
    assert r.choices[0].text == text
