"""`llama32 serve` on a Llama 3.2 Vision checkpoint (golden/toy-vision), through the official openai client: chats
with image_url parts (base64 data: URLs) get exactly the greedy ids `llama32 generate --image --chat --json` gives
the same prompt alone, several at once beside text-only chats; bad image parts are 400s naming the part."""
import base64
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("openai")

from tests._badinput import run_cli  # noqa: E402
from tests._serve_helpers import LiveServer  # noqa: E402
from tools.debug.golden_record import DEFAULT_DIR  # noqa: E402

TOY = DEFAULT_DIR / "toy-vision"
IMAGE = TOY / "image.png"


@pytest.fixture(scope="module")
def server():
    s = LiveServer(model=TOY)
    yield s
    s.close()


def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def generate_json(prompt, n, *extra):
    r = run_cli(["generate", prompt, "--model", TOY, "--backend", "refimpl", "--max-new-tokens", n, "--chat",
                 "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def chat_ids(server, content, n):
    """(the completion's text, its usage): the API returns text, not ids."""
    client = server.client()
    out = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": content}],
                                         max_tokens=n, temperature=0)
    return out.choices[0].message.content, out.usage


def test_image_chat_equals_generate_image_chat(server):
    from concurrent.futures import ThreadPoolExecutor
    image_part = {"type": "image_url", "image_url": {"url": data_url(IMAGE)}}
    asks = [([image_part, {"type": "text", "text": "What is this?"}], "What is this?", 6, True),
            ("a chat without any image", "a chat without any image", 5, False),
            ([image_part, {"type": "text", "text": "Describe the sea."}], "Describe the sea.", 8, True)]
    with ThreadPoolExecutor(len(asks)) as pool:  # in flight together: one batch
        got = list(pool.map(lambda a: chat_ids(server, a[0], a[2]), asks))
    for (content, prompt, n, with_image), (text, usage) in zip(asks, got):
        want = generate_json(prompt, n, *(["--image", IMAGE] if with_image else []))
        assert text == want["text"], prompt
        assert usage.prompt_tokens == len(want["prompt_ids"]) and usage.completion_tokens == len(
            want["generated_ids"]), prompt
    # the image matters
    assert got[0][0] != generate_json("What is this?", 6)["text"]


def test_bad_image_part_is_a_400_naming_it(server):
    r = server.post("/v1/chat/completions", {"model": server.name, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages.0.content.0.image_url"
    r = server.post("/v1/chat/completions", {"model": server.name, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "two: <|image|>"},
        {"type": "image_url", "image_url": {"url": data_url(IMAGE)}}]}]})
    assert r.status_code == 400 and "2 <|image|> token(s) but 1 image" in r.json()["error"]["message"]
