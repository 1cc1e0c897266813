"""Fuzz every public endpoint from the OpenAPI descriptions with schemathesis, against the real
processes (uvicorn + a Celery pool worker with the simulated engine), with valid credentials.

Two documents: the management API (``/api/schema/``, drf-spectacular) and the inference API
(``/v1/openapi.json``, ``gateway.inference.openapi``). Each operation gets positive and negative
cases (bounded so the module runs in well under a minute) and the checks ``not_a_server_error``,
``status_code_conformance``, ``response_schema_conformance`` (and content-type conformance).
For the inference API every refused request (4xx) is also checked to have charged nothing:
the tenant's and key's buckets, slots and open-stream counters and the usage queue are
exactly as before it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from infra.redis_conn import key
from tenants.management_tokens import issue_token
from tests import procs, rkeys
from tests import test_inference_live as live_module
from tests.live_pool import MODEL
from tests.live_pool import tenant_key as live_tenant_key
from tests.worlds import build_world

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance,
          content_type_conformance]
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
system = live_module.system  # the processes: one gateway, one pool worker, for this module
live = live_module.live
# Per mode and operation. The cases are derandomized (the same ones every run): a run is a fixed
# regression set over every operation, so these bound what it costs, not what it may find.
EXAMPLES_PER_OPERATION = 30
MANAGEMENT_EXAMPLES = 4  # the management API has some 70 operations


def _operations(schema: Any) -> list[Any]:
    return [result.ok() for result in schema.get_all_operations()]


def _fuzz(operation: Any, strategy: st.SearchStrategy[Any], run: Callable[[Any], None],
          examples: int = EXAMPLES_PER_OPERATION) -> str | None:
    """Run ``run`` on generated cases; the failure found (shrunk), if any."""
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def each(case: Any) -> None:
        run(case)

    try:
        each()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # schemathesis' FailureGroup is an exception group
        return f"{operation.label}: {type(exc).__name__}: {str(exc)[:1500]}"
    return None


# -- the inference API -----------------------------------------------------------------------


def _snapshot(redis_client: Any, api_key: Any) -> dict[str, Any]:
    """Everything an admission would change for this tenant and key."""
    tenant = api_key.tenant_id
    names = [rkeys.bucket_key(tenant, scope, ident, kind) for scope, ident in
             (("tenant", tenant), ("key", api_key.pk)) for kind in ("in", "out")]
    counters = [rkeys.counter_key(name, tenant, scope, api_key.pk)
                for name in ("conc", "streams") for scope in ("tenant", "key")]
    return {"buckets": {n: redis_client.hgetall(n) for n in names},
            "counters": [redis_client.get(c) for c in counters],
            "usage": len(rkeys.usage_raw(redis_client)),
            "requests": sorted(redis_client.keys(key("req", "*")))}


def _settled(redis_client: Any, api_key: Any) -> bool:
    return all(int(redis_client.get(k) or 0) == 0 for k in (
        rkeys.counter_key("conc", api_key.tenant_id),
        rkeys.counter_key("streams", api_key.tenant_id)))


def _with_known_model(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Half the bodies name the served model, so cases get past routing into admission."""
    def fix(pair: tuple[Any, bool]) -> Any:
        case, known = pair
        if known and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL
        return case

    return st.tuples(strategy, st.booleans()).map(fix)


def test_inference_api_fuzz(live, redis_client) -> None:
    # Small output cap: a fuzzed request without max_tokens must not generate for long.
    api_key, plain = live_tenant_key(max_output_tokens=16, max_context_tokens=2048)
    auth = {"Authorization": f"Bearer {plain}"}
    schema = schemathesis.openapi.from_url(live["url"] + "/v1/openapi.json")
    statuses: list[int] = []
    failures: list[str | None] = []

    def run(case: Any) -> None:
        before = _snapshot(redis_client, api_key)
        response = case.call(base_url=live["url"], headers=auth, timeout=30)
        statuses.append(response.status_code)
        case.validate_response(response, checks=CHECKS)
        if 400 <= response.status_code < 500:
            assert _snapshot(redis_client, api_key) == before, (
                f"a refused request ({response.status_code}) charged something: "
                f"{response.text[:200]}")
        else:  # let its charge settle, so the next refusal is compared with a still state
            procs.wait_until(lambda: _settled(redis_client, api_key), 10, "settlement")

    for operation in _operations(schema):
        for mode in MODES:
            strategy = operation.as_strategy(generation_mode=mode,
                                             path_parameters={"model": MODEL}
                                             if "{model}" in operation.path else None)
            if operation.method.upper() == "GET":
                strategy = st.one_of(strategy, operation.as_strategy(generation_mode=mode))
            failures.append(_fuzz(operation, _with_known_model(strategy), run))
    assert not [f for f in failures if f], "\n\n".join(f for f in failures if f)
    assert not [s for s in statuses if s >= 500]
    print("inference fuzz statuses:", dict(sorted(Counter(statuses).items())))
    assert 200 in statuses and any(400 <= s < 500 for s in statuses)  # both kinds were hit


# -- the management API ----------------------------------------------------------------------


@pytest.fixture
def world(live):
    return build_world()


def test_management_api_fuzz(live, world) -> None:
    _, plain = issue_token(world.tenant, "fuzz", "owner", created_by=world.users["owner"])
    auth = {"Authorization": f"Bearer {plain}"}
    schema = schemathesis.openapi.from_url(live["url"] + "/api/schema/")
    statuses: list[int] = []
    failures: list[str | None] = []

    def run(case: Any) -> None:
        response = case.call(base_url=live["url"], headers=auth, timeout=30)
        statuses.append(response.status_code)
        case.validate_response(response, checks=CHECKS)

    operations = _operations(schema)
    assert len(operations) > 20
    for operation in operations:
        for mode in MODES:
            # The tenant in the path is the token's own, so cases reach the views.
            own = operation.as_strategy(generation_mode=mode, path_parameters={
                "tenant": world.tenant.slug} if "{tenant}" in operation.path else None)
            failures.append(_fuzz(operation, st.one_of(
                own, operation.as_strategy(generation_mode=mode)), run,
                examples=MANAGEMENT_EXAMPLES))
    assert not [f for f in failures if f], "\n\n".join(f for f in failures if f)
    assert not [s for s in statuses if s >= 500]
    print("management fuzz statuses:", dict(sorted(Counter(statuses).items())))
    assert any(200 <= s < 300 for s in statuses)
