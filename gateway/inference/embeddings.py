"""``POST /v1/embeddings``: embedding vectors from an embedding model's pool.

The same path as a completion: authenticate -> parse -> route to a pool of an embedding model
(``ServedModel.task == "embed"``) -> tokenize every input -> size against the limits -> shed ->
submit (one admission charging the inputs' tokens, no output) -> the worker pools them in one
engine call (``workers.host.EngineHost._embed``) -> settle for the input tokens. So embeddings
are metered and budgeted in input tokens (I2), scheduled by the pool's WFQ like any request
(I3), and salted and routed per tenant (I1).

Inputs: a string, an array of strings, an array of token ids, or an array of such arrays (at
most 2,048, as OpenAI allows). ``encoding_format`` ``float`` (default) or ``base64`` (the
little-endian float32 bytes, as the official client decodes them); ``dimensions`` shortens the
vectors where the model supports it.
"""

from __future__ import annotations

import base64
import json
from array import array
from dataclasses import dataclass
from typing import Any

from gateway.inference.errors import (
    ApiError,
    context_length_exceeded,
    invalid_request,
    unknown_parameter,
)
from gateway.inference.pools import ModelInfo
from serving.tokenization import load_tokenizer
from serving.wire import SamplingParams
from tenants.limits import Limits

MAX_INPUTS = 2048
FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    safety_identifier: str | None = None  # not an embeddings field


def _type_error(param: str, expected: str) -> ApiError:
    return invalid_request(f"Invalid type for '{param}': expected {expected}.", param=param,
                           code="invalid_type")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in value)


def parse(data: dict[str, Any]) -> EmbeddingRequest:
    fields = {k: v for k, v in data.items() if v is not None}
    for name in fields:
        if name not in FIELDS:
            raise unknown_parameter(name)
    model = fields.get("model")
    if not isinstance(model, str) or not model or len(model) > 256:
        raise invalid_request("you must provide a model parameter", param="model",
                              code="missing_required_parameter")
    raw = fields.get("input")
    if raw is None:
        raise invalid_request("Missing required parameter: 'input'.", param="input",
                              code="missing_required_parameter")
    if isinstance(raw, str) or _is_ids(raw):
        raw = [raw]
    if not isinstance(raw, list) or not raw or len(raw) > MAX_INPUTS:
        raise _type_error("input", f"a string, token ids, or an array of at most {MAX_INPUTS}")
    inputs: list[str | tuple[int, ...]] = []
    for i, item in enumerate(raw):
        if isinstance(item, str) and item:
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise invalid_request(f"'input[{i}]' is not valid Unicode text.",
                                      param="input", code="invalid_encoding") from None
            inputs.append(item)
        elif _is_ids(item):
            inputs.append(tuple(item))
        else:
            raise invalid_request(f"Invalid 'input[{i}]': expected a non-empty string or "
                                  "token ids.", param="input", code="invalid_value")
    fmt = fields.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise invalid_request("Invalid 'encoding_format': expected 'float' or 'base64'.",
                              param="encoding_format", code="invalid_value")
    dims = fields.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int)
                             or not 1 <= dims <= 65536):
        raise invalid_request("Invalid 'dimensions': expected an integer from 1 to 65536.",
                              param="dimensions", code="invalid_value")
    user = fields.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise _type_error("user", "a string of at most 256 characters")
    return EmbeddingRequest(model, tuple(inputs), fmt, dims, user)


def tokenize(req: EmbeddingRequest, model: ModelInfo, limits: Limits) -> list[list[int]]:
    """Token ids of every input, each checked against the context window."""
    tokenizer = load_tokenizer(model.tokenizer_path)
    window = min(limits.max_context_tokens, model.max_model_len)
    out = []
    for item in req.inputs:
        ids = list(item) if isinstance(item, tuple) else tokenizer.encode(item)
        if isinstance(item, tuple) and max(ids) >= tokenizer.vocab_size:
            raise invalid_request(f"Token ids must be below the vocabulary size "
                                  f"({tokenizer.vocab_size}).", param="input",
                                  code="invalid_value")
        if not ids:
            raise invalid_request("An input is empty after tokenizing.", param="input",
                                  code="invalid_value")
        if len(ids) > window:
            raise context_length_exceeded(window, len(ids), None)
        out.append(ids)
    return out


def sampling(req: EmbeddingRequest, prompts: list[list[int]]) -> SamplingParams:
    return SamplingParams(max_tokens=0, embed_segments=tuple(len(p) for p in prompts),
                          dimensions=req.dimensions)


def unpack(text: str) -> list[list[float]]:
    """The worker's packed vectors (``workers.host.pack_vectors``) back to lists."""
    packed = json.loads(text)
    flat = array("f")
    flat.frombytes(base64.b64decode(packed["v"]))
    width = int(packed["d"])
    return [flat[i:i + width].tolist() for i in range(0, len(flat), width)] if width else []


def body(req: EmbeddingRequest, vectors: list[list[float]], prompt_tokens: int
         ) -> dict[str, Any]:
    data = []
    for i, vec in enumerate(vectors):
        if req.encoding_format == "base64":
            value: Any = base64.b64encode(array("f", vec).tobytes()).decode()
        else:
            value = vec
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {"object": "list", "data": data, "model": req.model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
