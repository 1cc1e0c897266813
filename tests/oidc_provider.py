"""A local identity provider for the OIDC tests: a JWKS endpoint that can be healthy, failing
(500) or hanging, the keys' public JWKs, and tokens signed as the provider would sign them."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt

from tenants.auth import authenticate_request

ISSUER = "https://idp.acme.example/"
AUDIENCE = "inference-gateway"


class JwksServer:
    """A JWKS endpoint on 127.0.0.1 serving ``keys``; ``mode`` is "ok", "fail" (500),
    "hang" (sleeps ``hang_s`` first, then fails: an answer too late to use) or "trickle" (the
    right answer, one byte every ``trickle_s``: each socket read is quick, the whole is not)."""

    def __init__(self, keys: list[dict[str, Any]] | None = None) -> None:
        self.keys = keys or []
        self.mode = "ok"
        self.hang_s = 2.0
        self.trickle_s = 0.2
        self.fetches = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.fetches += 1
                if outer.mode == "hang":
                    time.sleep(outer.hang_s)
                if outer.mode not in ("ok", "trickle"):
                    self.send_response(500)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = json.dumps({"keys": outer.keys}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if outer.mode == "trickle":
                    for i in range(len(body)):
                        time.sleep(outer.trickle_s)
                        try:
                            self.wfile.write(body[i:i + 1])
                            self.wfile.flush()
                        except OSError:
                            return  # the client gave up
                    return
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/jwks.json"
        threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def public_jwk(private_key: Any, kid: str, alg: str) -> dict[str, Any]:
    algo = jwt.get_algorithm_by_name(alg)
    data = json.loads(algo.to_jwk(private_key.public_key()))
    return data | {"kid": kid, "alg": alg, "use": "sig"}


def token(key: Any, *, kid: str = "k1", alg: str = "RS256", **overrides: Any) -> str:
    now = int(time.time())
    claims = {"iss": ISSUER, "aud": AUDIENCE, "sub": "svc-1", "iat": now, "nbf": now - 1,
              "exp": now + 300} | overrides
    claims = {k: v for k, v in claims.items() if v is not None}
    return jwt.encode(claims, key, algorithm=alg, headers={"kid": kid})


def call(tok: str) -> Any:
    return authenticate_request({"Authorization": f"Bearer {tok}"}, "203.0.113.9")


@contextlib.contextmanager
def fresh_jwks(keys: list[dict[str, Any]]) -> Iterator[JwksServer]:
    """A JWKS server serving ``keys``, the gateway's JWKS and auth caches emptied around it
    (keys another test's server served must not answer for this one)."""
    from tenants import auth, oidc

    server = JwksServer(keys)
    oidc.jwks_cache.clear()
    auth.clear_cache()
    try:
        yield server
    finally:
        server.close()
        oidc.jwks_cache.clear()
