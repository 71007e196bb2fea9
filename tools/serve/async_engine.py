"""The batched engine behind an asyncio server: one thread owns the engine, the event loop owns the clients.

The engine (accel.batch.BatchEngine) is not thread-safe and its `step()` blocks for a model step, so it runs in
one thread that takes commands (add, abort) from a queue between steps and hands each step's outputs to the
requests' asyncio queues with `call_soon_threadsafe`. The engine never waits for a client: a slow reader's
outputs pile up in its own queue (a few ints a token), and a client that goes away aborts its request, which frees
its KV blocks at the next step. A step that raises fails the requests it ran (500), not the server.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from refimpl.errors import Llama32Error
from tools.serve.metrics import Metrics


@dataclass
class EngineFailure:
    message: str
    refused: bool = False  # the engine refused the request itself (a 400), not a failed step (a 500)


class RequestRefused(RuntimeError):
    """The engine would not take the request (e.g. it needs more KV blocks than the pool holds)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrived: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None


class AsyncEngine:
    def __init__(self, engine, metrics: Metrics | None = None, idle_wait: float = 0.05):
        self.engine, self.metrics = engine, metrics or Metrics()
        self.idle_wait = idle_wait
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = False
        self.stats: dict = dict(engine.stats())
        self._thread = threading.Thread(target=self._run, name="llama32-engine", daemon=True)
        self._thread.start()

    # ---- the event loop's side ----
    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    async def generate(self, request_id: str, prompt_ids: list[int], params, adapter: str | None = None,
                       images=None) -> AsyncIterator:
        """The engine's RequestOutputs for one request, ending with the finished one. Leaving early (the client
        went away, or the caller stopped reading) aborts the request."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt_ids, params, adapter, images))
        finished = False
        try:
            while True:
                out = await stream.queue.get()
                if isinstance(out, EngineFailure):
                    raise (RequestRefused if out.refused else RuntimeError)(out.message)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- the engine thread ----
    def _run(self) -> None:
        while not self._stopping:
            self._take_commands()
            if not self.engine.has_unfinished():
                self.stats = dict(self.engine.stats())
                self._wake.wait(self.idle_wait)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug, not a bad request (requests are checked before they are added)
                self._fail_running(f"the engine failed: {type(e).__name__}: {e}")
                continue
            self.stats = dict(self.engine.stats())
            now = time.perf_counter()
            for out in outputs:
                self._deliver(out.request_id, out, now)

    def _take_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, rid, prompt_ids, params, adapter, images = command
                try:
                    kwargs = {"adapter": adapter} if adapter is not None else {}
                    kwargs.update({"images": images} if images is not None else {})
                    self.engine.add_request(prompt_ids, params, request_id=rid, **kwargs)
                except Llama32Error as e:  # the request, not the engine: one line for the client
                    self._deliver(rid, EngineFailure(str(e), refused=True), time.perf_counter())
                except Exception as e:
                    self._deliver(rid, EngineFailure(f"{type(e).__name__}: {e}"), time.perf_counter())
            else:
                self.engine.abort(command[1])  # a request already finished: nothing to do

    def _fail_running(self, message: str) -> None:
        for rid in list(self._streams):
            try:
                self.engine.abort(rid)
            except Exception:
                pass
            self._deliver(rid, EngineFailure(message), time.perf_counter())

    def _deliver(self, rid: str, out, now: float) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        if not isinstance(out, EngineFailure) and out.new_token_ids:
            if stream.first_token is None:
                stream.first_token = now
                self.metrics.ttft.observe(now - stream.arrived)
            elif stream.last_token is not None:
                self.metrics.tpot.observe((now - stream.last_token) / len(out.new_token_ids))
            stream.last_token = now
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except RuntimeError:  # the event loop is closed: the server is going down
            pass
