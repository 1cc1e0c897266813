"""Command-line options for quotas and key limits, shared by the tenancy commands."""

from __future__ import annotations

from argparse import ArgumentParser
from collections.abc import Iterable, Mapping
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError

_FLOATS = {"ttft_deadline_s", "total_deadline_s"}
_HELP = {
    "input_tpm": "input (prompt) tokens per minute",
    "output_tpm": "output tokens per minute",
    "input_burst": "input bucket size in tokens (default: one minute of the rate)",
    "output_burst": "output bucket size in tokens (default: one minute of the rate)",
    "concurrent_requests": "requests in flight at once",
    "open_streams": "streaming responses open at once",
    "max_context_tokens": "largest prompt + max_tokens per request",
    "max_output_tokens": "largest max_tokens per request",
    "ttft_deadline_s": "seconds to the first token before cancelling",
    "total_deadline_s": "seconds for the whole request before cancelling",
}


def option_name(field: str) -> str:
    return "--" + field.removesuffix("_s").replace("_", "-")


def add_limit_arguments(parser: ArgumentParser, fields: Iterable[str]) -> None:
    for field in fields:
        parser.add_argument(
            option_name(field), dest=field, type=float if field in _FLOATS else int,
            metavar="SECONDS" if field in _FLOATS else "N", help=_HELP.get(field, field),
        )


def collect(options: Mapping[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    return {f: options[f] for f in fields if options.get(f) is not None}


def command_error(exc: ValidationError) -> CommandError:
    """A ValidationError as one readable line per problem, naming the option."""
    if hasattr(exc, "error_dict"):
        lines = [f"{option_name(field)}: {msg}" for field, msgs in exc.message_dict.items()
                 for msg in msgs]
    else:
        lines = list(exc.messages)
    return CommandError("; ".join(lines))
