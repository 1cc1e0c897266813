"""The gateway's uvicorn command line, written once.

Every way the gateway starts (the image's entrypoint, ``manage.py serve``, the test harness)
builds its command here, so the options that security depends on cannot drift apart:

- ``--no-proxy-headers``: ``scope["client"]`` stays the TCP peer; ``infra.clientaddr`` alone
  decides the client address from forwarded headers, and only from trusted proxies (uvicorn's
  own handling believes ``X-Forwarded-For`` from any peer in ``FORWARDED_ALLOW_IPS``);
- ``--http gateway.httpproto:BoundedHttpToolsProtocol``: deadlines on request headers
  (slow-loris) and open streams ended at shutdown.

``python -m infra.uvicorn_command [uvicorn options]`` replaces itself (exec, same process id,
so signals reach uvicorn) with that command; the image's entrypoint uses it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

APP = "gateway.asgi:application"
FIXED_OPTIONS = ("--http", "gateway.httpproto:BoundedHttpToolsProtocol", "--no-proxy-headers")


def uvicorn_argv(python: str, options: Sequence[str]) -> list[str]:
    """``python -m uvicorn APP`` with the fixed options, then ``options`` (host, port, ...)."""
    return [python, "-m", "uvicorn", APP, *FIXED_OPTIONS, *options]


def main(argv: Sequence[str]) -> None:
    command = uvicorn_argv(sys.executable, argv)
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
