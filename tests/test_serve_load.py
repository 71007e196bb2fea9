"""`llama32 serve` under load on CPU (toy checkpoint, 127.0.0.1 only, bounded in count and time): 200 concurrent
streaming clients get their solo answers, clients that disconnect mid-stream leave no KV blocks in use, memory stays
bounded; the CLI starts on 127.0.0.1, prints its URL and drains on Ctrl-C; the chat page works in a real browser."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests._serve_helpers import ROOT, TOY, LiveServer, free_port, require_browser

pytest.importorskip("fastapi")

ABORTED = 'vllm:request_success_total{finished_reason="abort"}'
PROMPTS = [f"the cat {'and ' * k}sat" for k in range(10)]


@pytest.fixture(scope="module")
def server():
    s = LiveServer(max_num_seqs=256)
    yield s
    s.close()


async def stream_text(client: httpx.AsyncClient, url: str, body: dict, leave_after: float | None = None) -> str:
    """The streamed text of one completion; with leave_after, the connection is dropped after that many seconds
    (mid-stream: the request asks for more tokens than that time gives)."""
    text = ""

    async def read():
        nonlocal text
        async with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    try:
        await asyncio.wait_for(read(), timeout=leave_after)
    except asyncio.TimeoutError:  # leaving the stream closes the connection
        pass
    return text


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_200_concurrent_streams_get_their_solo_answers_and_50_disconnects_free_their_blocks(server):
    url = f"{server.url}/v1/completions"
    headers = {"Authorization": f"Bearer {server.api_key}"}

    def body(prompt, max_tokens=24):
        return {"model": server.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}

    async def run():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(headers=headers, timeout=300, limits=limits) as client:
            solo = [await stream_text(client, url, body(p)) for p in PROMPTS]
            solo_long = [await stream_text(client, url, body(p, max_tokens=100)) for p in PROMPTS]
            rss0 = rss_bytes()
            aborts0 = server.metrics()[ABORTED]
            jobs = [stream_text(client, url, body(PROMPTS[i % len(PROMPTS)])) if i % 4 else
                    stream_text(client, url, body(PROMPTS[i % len(PROMPTS)], max_tokens=100), leave_after=1.0)
                    for i in range(200)]
            results = await asyncio.wait_for(asyncio.gather(*jobs), timeout=600)
            return solo, solo_long, results, rss0, aborts0

    solo, solo_long, results, rss0, aborts0 = asyncio.run(run())
    for i, text in enumerate(results):
        if i % 4:  # the 150 that read to the end
            assert text == solo[i % len(PROMPTS)], i
        else:  # the 50 that left early saw a prefix of the same answer
            assert solo_long[i % len(PROMPTS)].startswith(text), i
    deadline = time.time() + 60
    while True:
        m = server.metrics()
        if m["llama32:kv_blocks_used"] == 0 and m["vllm:num_requests_running"] == 0:
            break
        assert time.time() < deadline, f"blocks still in use after the clients left: {m['llama32:kv_blocks_used']}"
        time.sleep(0.2)
    assert m[ABORTED] - aborts0 == 50
    assert rss_bytes() - rss0 < 300 * 2 ** 20  # memory stays bounded


def test_a_non_streaming_client_that_leaves_aborts_its_request(server, monkeypatch):
    real_step = server.engine.engine.step

    def slow_step():  # 20 ms a step: the 120 tokens take seconds, so the client leaves mid-request on any machine
        time.sleep(0.02)
        return real_step()
    monkeypatch.setattr(server.engine.engine, "step", slow_step)

    async def run():
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {server.api_key}"}) as client:
            try:
                await client.post(f"{server.url}/v1/completions", timeout=0.3, json={
                    "model": server.name, "prompt": "the", "max_tokens": 120, "temperature": 1.0, "n": 8})
            except httpx.TimeoutException:
                pass
    before = server.metrics()[ABORTED]
    asyncio.run(run())
    deadline = time.time() + 60
    while server.metrics()[ABORTED] < before + 8:
        assert time.time() < deadline, "the abandoned request kept running"
        time.sleep(0.2)
    assert server.metrics()["llama32:kv_blocks_used"] == 0


def test_cli_binds_loopback_prints_its_url_and_drains_on_ctrl_c():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "LLAMA32_API_KEY": ""}
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "serve", "--model", str(TOY), "--device", "cpu",
                             "--port", str(port)], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert f"at http://127.0.0.1:{port}/" in line, line
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health").text == "ok"  # the URL is printed once the server accepts connections
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "model": "toy-gqa", "prompt": "the", "max_tokens": 40, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGINT)  # Ctrl-C while a request streams: it finishes, then the server exits
            rest = list(lines)
        assert "data: [DONE]" in rest
        assert proc.wait(60) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_url_is_announced_once_the_socket_accepts_connections():
    """bound_server calls back after uvicorn bound its socket (an app whose startup takes a while: not before)."""
    import asyncio
    import contextlib
    import socket

    import uvicorn

    from tools.serve.server import bound_server

    @contextlib.asynccontextmanager
    async def slow_startup(app):
        await asyncio.sleep(0.3)
        yield

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            async with slow_startup(app):
                await receive()  # startup
                await send({"type": "lifespan.startup.complete"})
                await receive()  # shutdown
                await send({"type": "lifespan.shutdown.complete"})

    port, seen = free_port(), []

    def on_started():
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            seen.append("connected")
        server.should_exit = True
    server = bound_server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"), on_started)
    server.run()
    assert seen == ["connected"]


def test_cli_refuses_bad_settings_in_one_line():
    from click.testing import CliRunner
    from tools.cli import main
    for args, needle in ((["--tp", "3"], "--tp 3 does not divide"), (["--lora", "noequals"], "NAME=DIR"),
                         (["--quant", "int8"], "--quant"), (["--gpu-memory", "lots"], "--gpu-memory")):
        r = CliRunner().invoke(main, ["serve", "--model", str(TOY), "--device", "cpu", *args])
        assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1


def test_chat_page_streams_an_answer_in_a_real_browser(server):
    require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    want = server.client().chat.completions.create(model=server.name, temperature=0,
                                                   messages=[{"role": "user", "content": "the cat"}])
    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    import shutil
    opts.binary_location = shutil.which("chromium")
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        driver.get(server.url + "/")
        driver.find_element(By.ID, "api-key").send_keys(server.api_key)
        driver.execute_script("loadModels()")
        WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
        driver.find_element(By.ID, "temperature").clear()
        driver.find_element(By.ID, "temperature").send_keys("0")
        driver.find_element(By.ID, "input").send_keys("the cat")
        driver.find_element(By.ID, "send").click()
        done = WebDriverWait(driver, 120).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done='true']"))
        shown = driver.execute_script("return document.querySelector('.msg.assistant span').textContent")
        assert shown == want.choices[0].message.content
        assert not driver.find_elements(By.CSS_SELECTOR, ".msg.error")
        assert driver.find_element(By.ID, "send").is_enabled()
    finally:
        driver.quit()
