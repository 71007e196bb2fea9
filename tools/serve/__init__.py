"""`llama32 serve`: an OpenAI-compatible server on the batched engine (accel.batch), laid out as vLLM's
entrypoints/openai:

    protocol.py      the request bodies (pydantic) and APIError, OpenAI's error body
    requests.py      a request -> prompt ids and sampling parameters per choice, checked against the model
    media.py         image_url parts (base64 data: URLs; file:// under --allowed-local-media; never fetched)
    async_engine.py  the engine in its own thread, each request an async stream of outputs
    metrics.py       /metrics in Prometheus' text format
    app.py           the routes; chat.html, the chat page at /
    server.py        loading the model and running uvicorn

Ids become streamed text (with stop strings) through tools/text_stream.py, shared with generate, chat and batch.
"""
