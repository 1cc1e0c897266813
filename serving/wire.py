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
from dataclasses import asdict, dataclass
from typing import Any

# Stored in req:{rid} at admission, handed to the worker and deleted at claim: the prompt ids
# are content in transit, so they live in Redis only until a worker takes them.
PAYLOAD_FIELDS = ("prompt_ids", "sampling", "salt", "priority", "adapter")


class FinishReason:
    STOP = "stop"  # end-of-sequence token or a stop sequence
    LENGTH = "length"  # max_tokens reached (or the context window)
    ABORT = "abort"  # aborted by id (client gone, deadline)
    ERROR = "error"  # the engine failed this request


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


def pack_prompt(ids: Sequence[int]) -> bytes:
    """Prompt ids as little-endian uint32: 4 bytes a token in Redis, not JSON digits."""
    packed = array("I", ids)
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte "I"
        raise RuntimeError("array('I') is not 4 bytes here")
    return packed.tobytes()


def unpack_prompt(data: bytes) -> list[int]:
    return array("I", data).tolist()


def pack_sampling(sampling: SamplingParams) -> str:
    return json.dumps(asdict(sampling), separators=(",", ":"))


def unpack_sampling(data: bytes | str) -> SamplingParams:
    raw: dict[str, Any] = json.loads(data)
    raw["stop"] = tuple(raw.get("stop") or ())
    raw["stop_token_ids"] = tuple(raw.get("stop_token_ids") or ())
    return SamplingParams(**raw)


def usage_of(prompt: int, completion: int, cached: int = 0) -> dict[str, int]:
    """The ``usage`` object of a stream's final entry, in OpenAI's field names."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached,
            "total_tokens": prompt + completion}


def text(value: object) -> str:
    """A script reply element as text (redis-py hands back bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)
