"""`llama32 serve` against the official `openai` client on 127.0.0.1 (CPU, toy checkpoint): answers equal
`llama32 generate --json` (the refimpl engine, an independent oracle), streaming equals non-streaming, stop
strings, n, seeds, usage, and every refusal a 4xx with OpenAI's error body while the server stays healthy."""
from __future__ import annotations

import json

import httpx
import pytest
from click.testing import CliRunner

from tests._serve_helpers import API_KEY, TOY, LiveServer
from tools.cli import main

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server():
    s = LiveServer()
    yield s
    s.close()


def generate_json(prompt: str, chat: bool, max_new_tokens: int) -> dict:
    """The oracle: `llama32 generate --json` on the refimpl backend."""
    args = ["generate", "--model", str(TOY), "--backend", "refimpl", "--max-new-tokens", str(max_new_tokens),
            "--json", "--chat" if chat else "--no-chat", prompt]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


def test_models_lists_the_base_model(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [server.name] == ["toy-gqa"]


def test_chat_greedy_equals_generate_json(server):
    want = generate_json("the cat sat", chat=True, max_new_tokens=12)
    r = server.client().chat.completions.create(model=server.name, max_tokens=12, temperature=0,
                                                messages=[{"role": "user", "content": "the cat sat"}])
    assert r.choices[0].message.content == want["text"]
    assert r.usage.prompt_tokens == len(want["prompt_ids"])
    assert r.usage.completion_tokens == len(want["generated_ids"])
    assert r.choices[0].finish_reason == ("stop" if want["stopped_on_eos"] else "length")


def test_completion_greedy_equals_generate_json(server):
    want = generate_json("and the sea", chat=False, max_new_tokens=10)
    r = server.client().completions.create(model=server.name, prompt="and the sea", max_tokens=10, temperature=0)
    assert r.choices[0].text == want["text"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want["prompt_ids"]), len(want["generated_ids"]))


def test_token_id_prompt_equals_text_prompt(server):
    c = server.client()
    ids = generate_json("was it", chat=False, max_new_tokens=6)["prompt_ids"]
    a = c.completions.create(model=server.name, prompt="was it", max_tokens=6, temperature=0)
    b = c.completions.create(model=server.name, prompt=ids, max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_equals_non_stream(server, kind):
    c = server.client()
    kw = dict(model=server.name, max_tokens=14, temperature=0.9, seed=7)
    if kind == "chat":
        kw["messages"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the sea"}]
        whole = c.chat.completions.create(**kw).choices[0].message.content
        chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        kw["prompt"] = "the sea"
        whole = c.completions.create(**kw).choices[0].text
        chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(ch.usage is None for ch in chunks[:-1])


def test_raw_stream_ends_with_done(server):
    body = {"model": server.name, "prompt": "the", "max_tokens": 4, "stream": True}
    r = server.post("/v1/completions", body)
    events = [e for e in r.text.split("\n\n") if e]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])


def test_stop_string_cuts_the_answer(server):
    c = server.client()
    full = c.completions.create(model=server.name, prompt="in the", max_tokens=16, temperature=0).choices[0].text
    stop = next(full[i:i + 2] for i in range(1, len(full) - 1) if full[i:i + 2].strip() and full.find(full[i:i + 2]) == i)
    want = full[:full.find(stop)]
    r = c.completions.create(model=server.name, prompt="in the", max_tokens=16, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    assert r.usage.completion_tokens < 16
    streamed = c.completions.create(model=server.name, prompt="in the", max_tokens=16, temperature=0, stop=stop,
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == want


def test_n_choices_are_the_seeded_requests_alone(server):
    """Choice i of a seeded request with n choices draws with seed + i: the same tokens as a request alone."""
    c = server.client()
    kw = dict(model=server.name, prompt="the cat", max_tokens=12, temperature=1.2)
    many = c.completions.create(**kw, n=3, seed=40)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    alone = [c.completions.create(**kw, seed=40 + i).choices[0].text for i in range(3)]
    assert [ch.text for ch in many.choices] == alone
    assert len(set(alone)) > 1  # different seeds drew different answers
    assert many.usage.completion_tokens == sum(
        c.completions.create(**kw, seed=40 + i).usage.completion_tokens for i in range(3))


def test_seed_repeats_while_other_requests_share_the_batch(server):
    import concurrent.futures as cf
    c = server.client()
    kw = dict(model=server.name, prompt="the cat", max_tokens=12, temperature=1.0, seed=5)
    alone = c.completions.create(**kw).choices[0].text
    with cf.ThreadPoolExecutor(8) as pool:
        noise = [pool.submit(c.completions.create, model=server.name, prompt="and " * (i + 1), max_tokens=10,
                             temperature=1.0) for i in range(6)]
        crowded = pool.submit(c.completions.create, **kw)
        assert crowded.result().choices[0].text == alone
        [f.result() for f in noise]


BAD = [
    ("invalid JSON", "/v1/chat/completions", b"{nope", 400, None),
    ("body not an object", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("unknown field", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "bogus": 1}, 400,
     "bogus"),
    ("no messages", "/v1/chat/completions", {}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("temperature", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400,
     "temperature"),
    ("top_p 0", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("n too large", "/v1/completions", {"prompt": "x", "n": 99}, 400, "n"),
    ("max_tokens 0", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("past the context", "/v1/completions", {"prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
    ("prompt past the context", "/v1/completions", {"prompt": "the " * 300}, 400, "prompt"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                       "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("json mode", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                           "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("logit_bias", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("echo", "/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("stream_options without stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("too many stops", "/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("remote image", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]}]}, 400, None),
    ("image on a text model", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400,
     "messages.0.content.0.image_url"),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-5"}, 404, "model"),
]


@pytest.mark.parametrize("what,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors_and_the_server_stays_up(server, what, path, body, status, param):
    if isinstance(body, dict):
        body = {"model": server.name, **body}
    r = server.post(path, None, raw=body if isinstance(body, bytes) else json.dumps(body).encode())
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    assert httpx.get(f"{server.url}/health").text == "ok"
    ok = server.client().completions.create(model=server.name, prompt="the", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_the_openai_client_raises_its_own_errors(server):
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client().chat.completions.create(model=server.name, messages=[{"role": "user", "content": "x"}],
                                                temperature=-1)


def test_api_key_is_required_on_v1_routes(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client(default_headers={"Authorization": "Bearer wrong"}).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics stay open
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_body_over_the_limit_is_413(server):
    r = server.post("/v1/completions", None, raw=b"{" + b" " * (33 * 2 ** 20) + b"}")
    assert r.status_code == 413


def test_metrics_count_tokens_and_latencies(server):
    before = server.metrics()
    r = server.client().completions.create(model=server.name, prompt="the cat", max_tokens=5, temperature=0)
    after = server.metrics()
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == \
        r.usage.completion_tokens
    assert after["vllm:time_to_first_token_seconds_count"] > before["vllm:time_to_first_token_seconds_count"]
    assert after["llama32:kv_blocks_used"] == 0 and after["llama32:kv_blocks_free"] > 0


def test_a_failing_engine_step_fails_its_requests_not_the_server(server, monkeypatch):
    real = server.engine.engine.step
    calls = []

    def broken():
        if not calls:
            calls.append(1)
            raise ValueError("injected")
        return real()
    monkeypatch.setattr(server.engine.engine, "step", broken)
    r = server.post("/v1/completions", {"model": server.name, "prompt": "the", "max_tokens": 3})
    assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
    monkeypatch.setattr(server.engine.engine, "step", real)
    ok = server.client().completions.create(model=server.name, prompt="the", max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert server.metrics()["llama32:kv_blocks_used"] == 0


def test_a_request_the_engine_refuses_is_a_400_not_a_500(server, monkeypatch):
    """What add_request refuses in the engine thread (say, more KV blocks than the pool holds) reaches the client as
    a 400 with the engine's one-line reason, streaming or not."""
    from refimpl.errors import GenerationError

    def refuse(*a, **k):
        raise GenerationError("request 'x': 300 tokens need 19 KV blocks but the pool holds 8")
    monkeypatch.setattr(server.engine.engine, "add_request", refuse)
    r = server.post("/v1/completions", {"model": server.name, "prompt": "the", "max_tokens": 3})
    assert r.status_code == 400 and "the pool holds 8" in r.json()["error"]["message"]
    r = server.post("/v1/completions", {"model": server.name, "prompt": "the", "max_tokens": 3, "stream": True})
    error = json.loads(r.text.split("\n\n")[0][len("data: "):])["error"]
    assert "the pool holds 8" in error["message"] and error["type"] == "invalid_request_error"
    monkeypatch.undo()
    assert httpx.get(f"{server.url}/health").text == "ok"
