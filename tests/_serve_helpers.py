"""A live `llama32 serve` app on 127.0.0.1 for the server tests: uvicorn in a thread of the test process, the
batched engine on the CPU over a toy checkpoint."""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "golden" / "toy-gqa"
API_KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, model=TOY, api_key=API_KEY, adapters=None, media=None, max_num_seqs=64, **kw):
        import uvicorn
        from tools.serve.server import load_served

        self.app, self.engine, self.name = load_served(str(model), adapters or {}, None, "cpu", "fp32", max_num_seqs,
                                                       512, 0.9, media, api_key)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    **kw))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def client(self, **kw):
        from openai import OpenAI
        return OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        import httpx
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def post(self, path: str, body, headers=None, raw: bytes | None = None):
        import httpx
        h = {"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json", **(headers or {})}
        content = raw if raw is not None else json.dumps(body).encode()
        return httpx.post(f"{self.url}{path}", content=content, headers=h, timeout=120)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()


def require_browser():
    """Debian's chromium and its driver: .ci/run installs them; locally a test without them skips, in CI fails."""
    import os
    import shutil
    missing = [b for b in ("chromium", "chromedriver") if shutil.which(b) is None]
    if missing:
        message = f"{', '.join(missing)} not installed (apt-get install chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
