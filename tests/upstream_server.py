"""A stand-in for ``vllm serve``: the simulated engine behind vLLM's OpenAI wire format.

Tests of the upstream backend need a server that speaks what a vLLM fleet speaks, including
the parts plain OpenAI servers lack: token-id prompts, ``cache_salt`` (honoured: the simulated
engine's prefix cache is keyed by it), ``return_token_ids``, the final usage chunk with
``prompt_tokens_details.cached_tokens``, and aborting a request when its client disconnects.

    python -m tests.upstream_server --port 8101 [--model sim] [--max-model-len 4096]

Endpoints: ``GET /v1/models``, ``POST /v1/completions`` (streaming or not), ``GET /health``,
and ``GET /debug/load`` (the engine's load, so a test can see that an abort freed the
sequence inside the upstream). A raw ASGI app on uvicorn: no framework to install.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import asdict
from typing import Any

from bench.asgi_io import Receive, Send, read_body, send_json
from workers.engine.base import EngineError, EngineRequest, SamplingParams
from workers.engine.simulated import SimConfig, SimulatedEngine


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _error(message: str, status: int) -> dict[str, Any]:
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


class WireServer:
    def __init__(self, engine: SimulatedEngine, model: str, adapters: tuple[str, ...] = ()):
        self.engine = engine
        self.model = model
        self.adapters = adapters  # LoRA names served as models, as `vllm serve --lora-modules`
        self.fail_status = 0  # POST /debug/fail {"status": 503}: every completion fails so

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/health":
            await send_json(send, 200, {})
        elif method == "GET" and path == "/v1/models":
            cards = [{"id": name, "object": "model", "owned_by": "vllm",
                      "max_model_len": self.engine.config.max_model_len}
                     for name in (self.model, *self.adapters)]
            await send_json(send, 200, {"object": "list", "data": cards})
        elif method == "GET" and path == "/debug/load":
            await send_json(send, 200, asdict(self.engine.load()))
        elif method == "POST" and path == "/debug/fail":
            self.fail_status = int(json.loads(await read_body(receive) or b"{}").get("status") or 0)
            await send_json(send, 200, {"status": self.fail_status})
        elif method == "POST" and path == "/v1/completions" and self.fail_status:
            await read_body(receive)
            await send_json(send, self.fail_status, _error("injected failure", self.fail_status))
        elif method == "POST" and path == "/v1/completions":
            await self._completions(receive, send)
        else:
            await send_json(send, 404, _error("Not Found", 404))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.engine.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.engine.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _completions(self, receive: Receive, send: Send) -> None:
        try:
            req, stream, opts = self._parse(json.loads(await read_body(receive) or b"{}"))
        except BadRequest as exc:
            await send_json(send, exc.status, _error(str(exc), exc.status))
            return
        except ValueError:
            await send_json(send, 400, _error("body is not JSON", 400))
            return
        if stream:
            await self._stream(req, opts, receive, send)
        else:
            await self._whole(req, opts, send)

    def _parse(self, b: dict[str, Any]) -> tuple[EngineRequest, bool, dict[str, Any]]:
        if b.get("model") not in (self.model, *self.adapters):
            raise BadRequest(f"The model `{b.get('model')}` does not exist.", 404)
        tok = self.engine.tokenizer
        prompt = b.get("prompt")
        if isinstance(prompt, str):
            ids = tok.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            raise BadRequest("prompt must be a string or a non-empty list of token ids")
        if any(not 0 <= t < tok.vocab_size for t in ids):
            raise BadRequest("prompt contains token ids outside the vocabulary")
        max_tokens = b.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest("max_tokens must be a positive integer")
        if len(ids) + max_tokens > self.engine.config.max_model_len:
            raise BadRequest("This model's maximum context length is "
                             f"{self.engine.config.max_model_len} tokens.")
        salt = b.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise BadRequest("cache_salt must be a non-empty string")
        stop = b.get("stop") or ()
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=float(b.get("temperature", 1.0)),
            top_p=float(b.get("top_p", 1.0)), seed=b.get("seed"),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(b.get("stop_token_ids") or ()),
            ignore_eos=bool(b.get("ignore_eos", False)),
        )
        rid = f"cmpl-{uuid.uuid4().hex}"
        # No salt: the shared, unsalted cache, as vLLM does without one.
        req = EngineRequest(rid, list(ids), sampling, cache_salt=salt or "",
                            priority=int(b.get("priority", 0)))
        opts = {
            "usage": bool((b.get("stream_options") or {}).get("include_usage")),
            "token_ids": bool(b.get("return_token_ids")),
        }
        return req, bool(b.get("stream")), opts

    def _head(self, rid: str) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.model}

    @staticmethod
    def _usage(u: Any) -> dict[str, Any]:
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.output_tokens,
                "total_tokens": u.prompt_tokens + u.output_tokens,
                "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}

    async def _stream(self, req: EngineRequest, opts: dict[str, Any], receive: Receive,
                      send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        watcher = asyncio.get_running_loop().create_task(self._on_disconnect(req, receive))
        head = self._head(req.request_id)
        try:
            async for d in self.engine.generate(req):
                choice: dict[str, Any] = {"index": 0, "text": d.text, "logprobs": None,
                                          "finish_reason": d.finish_reason,
                                          "stop_reason": None}
                if opts["token_ids"]:
                    choice["token_ids"] = d.token_ids
                await _event(send, {**head, "choices": [choice]})
                if d.finish_reason is not None and opts["usage"] and d.usage is not None:
                    await _event(send, {**head, "choices": [], "usage": self._usage(d.usage)})
        except EngineError as exc:
            await _event(send, _error(str(exc), 500 if exc.retryable else 400))
        finally:
            watcher.cancel()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})

    async def _on_disconnect(self, req: EngineRequest, receive: Receive) -> None:
        # uvicorn drops writes to a closed connection silently: the disconnect message is the
        # only signal, and it must abort the sequence (as vLLM's server does).
        while (await receive())["type"] != "http.disconnect":
            pass
        await self.engine.abort(req.request_id)

    async def _whole(self, req: EngineRequest, opts: dict[str, Any], send: Send) -> None:
        text, ids, last = [], [], None
        try:
            async for d in self.engine.generate(req):
                text.append(d.text)
                ids += d.token_ids
                last = d
        except EngineError as exc:
            await send_json(send, 500, _error(str(exc), 500))
            return
        assert last is not None and last.usage is not None
        choice: dict[str, Any] = {"index": 0, "text": "".join(text), "logprobs": None,
                                  "finish_reason": last.finish_reason, "stop_reason": None}
        if opts["token_ids"]:
            choice["token_ids"] = ids
        await send_json(send, 200, {**self._head(req.request_id), "choices": [choice],
                                "usage": self._usage(last.usage)})


async def _event(send: Send, payload: dict[str, Any]) -> None:
    body = b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": body, "more_body": True})


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="sim")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--decode-tps", type=float, default=2000.0)
    ap.add_argument("--lora-module", action="append", default=[], help="adapter name to serve")
    args = ap.parse_args()
    config = SimConfig(max_running_seqs=16, kv_cache_tokens=64 * 1024,
                       max_model_len=args.max_model_len, decode_tokens_per_s=args.decode_tps,
                       pool_tokens_per_s=None, block_size=16)
    server = WireServer(SimulatedEngine(config), args.model, tuple(args.lora_module))
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(server, host="127.0.0.1", port=args.port, log_level="warning",
                    lifespan="on")


if __name__ == "__main__":
    main()
