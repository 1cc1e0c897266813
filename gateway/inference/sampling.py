"""A parsed request -> the engine's sampling parameters, refused by name where the pool's
backend cannot honour one (before anything is charged).

What each backend honours (docs/openai-compatibility.md has the table):

- ``simulated`` and ``vllm`` (in process): everything; the simulated engine's constrained
  decoding cannot satisfy ``pattern`` (``serving.guided``), so such schemas are refused.
- ``openai_upstream`` with the ``vllm`` dialect: everything (vLLM's completions endpoint takes
  the penalties, ``min_tokens``, ``structured_outputs`` and ``logprobs``, its tokens sent as
  exact ids with ``return_tokens_as_token_ids``).
- ``openai`` dialect: the OpenAI completions parameters (penalties, ``logit_bias``); no
  constrained decoding, so no ``response_format`` and no forced ``tool_choice``; no
  ``logprobs`` (an unknown server's token strings need not be the gateway's tokenizer's); no
  ``ignore_eos`` (a vLLM extension the OpenAI wire format lacks).
- ``llama_cpp`` dialect: presence and frequency penalties, and ``logprobs`` (llama.cpp's token
  text mapped to the model's ids with the same vocabulary); no ``ignore_eos``.

``n`` and plain tools (``auto``, parsed from the text) work on every backend: the worker runs n
sequences, and tool calls are read from the output by the gateway.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.inference.errors import ApiError
from gateway.inference.pools import PoolInfo
from gateway.inference.requests import InferenceRequest
from gateway.inference.tools import constraint
from serving.guided import SchemaError, check_schema
from serving.wire import OPTIONAL, SamplingParams

ALL = frozenset(OPTIONAL)
SUPPORTED: dict[tuple[str, str], frozenset[str]] = {
    ("simulated", ""): ALL,
    ("vllm", ""): ALL,
    ("openai_upstream", "vllm"): ALL,
    ("openai_upstream", "openai"): frozenset({"presence_penalty", "frequency_penalty",
                                              "logit_bias", "skip_special_tokens"}),
    ("openai_upstream", "llama_cpp"): frozenset({"presence_penalty", "frequency_penalty",
                                                 "logprobs", "skip_special_tokens"}),
}


def sampling_params(req: InferenceRequest, max_tokens: int,
                    tool_call_parser: str = "hermes") -> SamplingParams:
    c = constraint(req.tools, req.tool_choice, req.parallel_tool_calls, req.response_format)
    return SamplingParams(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
        stop=req.stop, ignore_eos=req.ignore_eos, n=req.n,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias,
        min_tokens=min(req.min_tokens, max_tokens), logprobs=req.logprobs,
        json_schema=c.json_schema, json_object=c.json_object,
        # Mistral's [TOOL_CALLS] is a special token: keep it in the text for the parser.
        skip_special_tokens=not (tool_call_parser == "mistral"
                                 and req.tool_choice.mode == "auto"),
        may_call_tools=req.kind == "chat" and req.tool_choice.mode == "auto" and bool(req.tools),
    )


def _param_name(field: str, req: InferenceRequest) -> str:
    if field in ("json_schema", "json_object"):
        return "tool_choice" if req.tool_choice.mode in ("function", "required") \
            else "response_format"
    if field == "skip_special_tokens":
        return "tools"
    return "top_logprobs" if field == "logprobs" and req.kind == "chat" and req.logprobs \
        else field


def check_supported(req: InferenceRequest, sampling: SamplingParams, pool: PoolInfo) -> None:
    """400 naming the first parameter the pool's backend cannot honour."""
    dialect = pool.dialect if pool.backend == "openai_upstream" else ""
    supported = SUPPORTED.get((pool.backend, dialect), frozenset())
    for field in sampling.non_default():
        if field not in supported:
            name = _param_name(field, req)
            raise ApiError(
                400, f"The parameter `{name}` is not supported for model `{req.model}` (its "
                f"{pool.backend} backend cannot honour it).", param=name,
                code="unsupported_parameter")
    check_schemas(req, sampling, pool)


def check_schemas(req: InferenceRequest, sampling: SamplingParams, pool: PoolInfo) -> None:
    """400 for a schema out of bounds or malformed, on every backend, before any engine or
    grammar compiler sees it (``serving.schema_limits``: a small schema can describe an
    exponential document); the simulated engine's own keyword limits on top. Linear time."""
    for i, tool in enumerate(req.tools):
        params = tool.get("function", {}).get("parameters")
        if params is not None:
            _check(params, f"tools[{i}].function.parameters", engine=False)
    if sampling.json_schema is not None:
        name = _param_name("json_schema", req)
        _check(json.loads(sampling.json_schema), name, engine=pool.backend == "simulated")


def _check(schema: Any, name: str, *, engine: bool) -> None:
    try:
        check_schema(schema, engine=engine)
    except SchemaError as exc:
        raise ApiError(400, f"Invalid schema in `{name}`: {exc}.", param=name,
                       code="invalid_value") from None
