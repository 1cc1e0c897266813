"""What crosses Redis between the gateway and a worker: the transit payload of a request, its
sampling parameters, and the usage a stream's final entry carries.

The gateway packs (``serving.submission``), the worker unpacks (``workers.host``), so both
sides read one definition. The engines take ``SamplingParams`` and report ``FinishReason``s in
these terms too (``workers.engine.base`` re-exports them).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from infra.redis_conn import text as text  # re-exported: the serving core's callers use it

# Stored in req:{rid} at admission, handed to the worker and deleted at claim: the prompt ids
# are content in transit, so they live in Redis only until a worker takes them.
# "trace": the W3C traceparent and enqueue time (infra.tracing.carrier), when tracing is on.
PAYLOAD_FIELDS = ("prompt_ids", "sampling", "salt", "priority", "adapter", "trace")


class FinishReason:
    STOP = "stop"  # end-of-sequence token or a stop sequence
    LENGTH = "length"  # max_tokens reached (or the context window)
    ABORT = "abort"  # aborted by id (client gone, deadline)
    ERROR = "error"  # the engine failed this request


@dataclass(frozen=True)
class SamplingParams:
    """What one engine sequence is sampled with (vLLM's names and neutral values).

    ``n`` choices are n sequences the worker runs side by side (``workers.host``); an engine
    sees ``n`` only as a hint, each of its sequences is one choice. ``json_schema`` (JSON text)
    and ``json_object`` constrain decoding to valid JSON (structured outputs).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and the top k
    json_schema: str | None = None
    json_object: bool = False
    skip_special_tokens: bool = True
    # tool_choice "auto" with tools offered: the output may be a tool call. A real model decides
    # from its prompt and ignores this; the simulated model calls a tool only when it is set
    # (``workers.engine.simtools``), so "none" stays text.
    may_call_tools: bool = False
    # Embeddings: the prompt is these segments' ids back to back (one input each), and the
    # request pools them instead of generating (max_tokens 0).
    embed_segments: tuple[int, ...] = ()
    dimensions: int | None = None

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None or self.json_object

    def non_default(self) -> list[str]:
        """Names of the parameters set away from their neutral value (capability checks)."""
        neutral = SamplingParams(max_tokens=self.max_tokens)
        return [name for name in OPTIONAL if getattr(self, name) != getattr(neutral, name)]


_FIELD_NAMES = tuple(f.name for f in fields(SamplingParams))
_FIELDS = frozenset(_FIELD_NAMES)
# The parameters a backend may not support (gateway.inference.sampling's capability table).
OPTIONAL = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
             "min_tokens", "logprobs", "json_schema", "json_object", "skip_special_tokens",
             "ignore_eos")


def pack_prompt(ids: Sequence[int]) -> bytes:
    """Prompt ids as little-endian uint32: 4 bytes a token in Redis, not JSON digits."""
    packed = array("I", ids)
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte "I"
        raise RuntimeError("array('I') is not 4 bytes here")
    return packed.tobytes()


def unpack_prompt(data: bytes) -> list[int]:
    return array("I", data).tolist()


def pack_sampling(sampling: SamplingParams) -> str:
    # The fields as they are (none is a dataclass): the same JSON as ``asdict``, which copies
    # every field recursively (a sixth of a request's packing, issue 30).
    return json.dumps({name: getattr(sampling, name) for name in _FIELD_NAMES},
                      separators=(",", ":"))


def unpack_sampling(data: bytes | str) -> SamplingParams:
    raw: dict[str, Any] = json.loads(data)
    raw["stop"] = tuple(raw.get("stop") or ())
    raw["stop_token_ids"] = tuple(raw.get("stop_token_ids") or ())
    raw["logit_bias"] = tuple((int(t), float(b)) for t, b in raw.get("logit_bias") or ())
    raw["embed_segments"] = tuple(raw.get("embed_segments") or ())
    # A field this side does not know (a newer gateway during a rolling deploy) is dropped:
    # every field is neutral at its default.
    return SamplingParams(**{k: v for k, v in raw.items() if k in _FIELDS})


def usage_of(prompt: int, completion: int, cached: int = 0) -> dict[str, int]:
    """The ``usage`` object of a stream's final entry, in OpenAI's field names."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached,
            "total_tokens": prompt + completion}


