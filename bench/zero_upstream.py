"""A zero-delay OpenAI-compatible completions server: the cheapest upstream there can be.

It streams ``max_tokens`` chunks (one per token, each its own write, as vLLM and llama.cpp's
servers do) with no model behind them, then the usage chunk and ``[DONE]``; the chunks are
pre-encoded, so its CPU per request is close to what uvicorn itself costs. Benches put it
behind an ``openai_upstream`` pool to measure what the gateway adds (``bench/ab.py``).

    python bench/zero_upstream.py --port 8101 [--model up]

Endpoints: ``POST /v1/completions`` (streaming or not), ``GET /v1/models``, ``GET /health``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from asgi_io import Receive, Send, read_body, send_json

WORDS = [f" w{i}" for i in range(64)]  # chunk texts (the usage chunk gives the exact count)


class ZeroUpstream:
    def __init__(self, model: str) -> None:
        self.model = model
        self.n = 0

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if scope["path"] == "/v1/completions":
            await self._completions(receive, send)
        elif scope["path"] == "/v1/models":
            await send_json(send, 200, {"object": "list", "data": [
                {"id": self.model, "object": "model", "max_model_len": 8192}]})
        else:
            await send_json(send, 200 if scope["path"] == "/health" else 404, {})

    async def _completions(self, receive: Receive, send: Send) -> None:
        req = json.loads(await read_body(receive) or b"{}")
        n = max(1, int(req.get("max_tokens") or 16))
        self.n += 1
        head = (f'{{"id":"cmpl-{self.n}","object":"text_completion",'
                f'"created":{int(time.time())},"model":"{self.model}",')
        prompt = req.get("prompt")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                 "total_tokens": prompt_tokens + n}
        if not req.get("stream"):
            await send_json(send, 200, {"id": f"cmpl-{self.n}", "object": "text_completion",
                                    "model": self.model, "usage": usage, "choices": [
                                        {"index": 0, "text": "".join(WORDS[i % 64]
                                                                     for i in range(n)),
                                         "finish_reason": "length", "logprobs": None}]})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(n):
            last = i == n - 1
            finish = '"length"' if last else "null"
            chunk = (head + f'"choices":[{{"index":0,"text":"{WORDS[i % 64]}","logprobs":null,'
                     f'"finish_reason":{finish}}}]}}')
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + chunk.encode() + b"\n\n"})
        tail = b""
        if (req.get("stream_options") or {}).get("include_usage"):
            usage_json = json.dumps(usage, separators=(",", ":"))
            tail = b"data: " + (head + f'"choices":[],"usage":{usage_json}}}').encode() + b"\n\n"
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n",
                    "more_body": False})


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="up")
    args = ap.parse_args()
    uvicorn.run(ZeroUpstream(args.model), host="127.0.0.1", port=args.port,
                log_level="warning", lifespan="on", access_log=False)


if __name__ == "__main__":
    main()
