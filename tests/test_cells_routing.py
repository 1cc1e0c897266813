"""Cells (docs/adr/0019) without processes: which cell serves a tenant, the forward decision,
the pool table a cell routes to, and a split tenant's limits in one cell."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from django.core.exceptions import ValidationError

from gateway.api.serializers import TenantSerializer
from gateway.inference import cells as routing
from gateway.inference import pools
from gateway.inference.errors import ApiError
from serving import cells
from serving.admission import AdmissionLimits, ScopeLimits
from tests.factories import make_pool, make_tenant

CELLS = {"east": {"url": "http://east.example/", "redis_url": "redis://east:6379/0"},
         "west": {"url": "http://west.example", "redis_url": "redis://west:6379/0"}}


@pytest.fixture
def two_cells(settings):
    settings.CELLS, settings.CELL, settings.DEFAULT_CELL = CELLS, "west", "east"
    return settings


def test_without_cells_every_gateway_serves_everyone(settings) -> None:
    settings.CELL = ""
    routing.check_cell(("east",), [])  # no exception: cells are off here


def test_a_tenant_is_served_in_its_cells_and_forwarded_home_from_others(two_cells) -> None:
    routing.check_cell(("east", "west"), [])  # west serves it: no forward
    with pytest.raises(routing.WrongCell) as wrong:
        routing.check_cell(("east",), [])
    assert (wrong.value.home, wrong.value.url) == ("east", "http://east.example")


def test_a_forwarded_request_is_never_forwarded_again(two_cells) -> None:
    with pytest.raises(ApiError) as err:
        routing.check_cell(("east",), [(b"X-IGW-Forwarded-From", b"east")])
    assert err.value.status == 421 and b"misdirected_request" in err.value.body()


def test_a_home_cell_that_is_not_configured_is_a_retryable_503(two_cells) -> None:
    with pytest.raises(ApiError) as err:
        routing.check_cell(("mars",), [])
    assert err.value.status == 503


@pytest.mark.django_db
def test_tenant_cells_home_first_and_unknown_cells_refused(two_cells) -> None:
    tenant = make_tenant()
    assert tenant.cells == ("east",)  # blank home: DEFAULT_CELL
    tenant.home_cell, tenant.extra_cells = "west", " east, west ,"
    assert tenant.cells == ("west", "east")
    tenant.extra_cells = "east,mars"
    with pytest.raises(ValidationError, match="mars"):
        tenant.clean()
    form = TenantSerializer(tenant, data={"extra_cells": "mars"}, partial=True)
    assert not form.is_valid() and "mars" in str(form.errors["extra_cells"])
    ok = TenantSerializer(tenant, data={"home_cell": "east", "extra_cells": "west"}, partial=True)
    assert ok.is_valid(), ok.errors
    assert {"home_cell", "extra_cells"} <= TenantSerializer(tenant).data.keys()


@pytest.mark.django_db
def test_a_cell_routes_only_to_its_own_pools(two_cells) -> None:
    make_pool(name="east-p", cell="east")
    make_pool(name="west-p", cell="west", region="elsewhere")
    mine = {"east-p", "west-p"}  # live modules before this one may leave committed pools
    assert [p.name for p in pools._cell_pools() if p.name in mine] == ["west-p"]
    cat = pools._load_catalog()
    # The tenant's region does not filter: reaching this cell already chose the region.
    assert [p.name for p in pools.candidates(cat, "sim-small", 1, "local")] == ["west-p"]
    two_cells.CELL = ""
    assert {p.name for p in pools._cell_pools()} >= mine


def test_a_split_tenant_gets_the_floor_and_a_part_of_its_counters() -> None:
    quota = cells.Share(10_000, 20_000, 6_000, 6_000)
    limits = AdmissionLimits(tenant=ScopeLimits(input_tpm=10_000, output_tpm=6_000,
                                                input_burst=20_000, output_burst=6_000,
                                                concurrent_requests=9, open_streams=None),
                             key=ScopeLimits(output_tpm=500))
    split = cells.split_limits(limits, quota, 3, 0.3)
    # 10 % of the quota per cell: what admit.lua enforces until the rebalancer records a share.
    assert (split.tenant.input_tpm, split.tenant.input_burst) == (1_000, 2_000)
    assert (split.tenant.output_tpm, split.tenant.output_burst) == (600, 600)
    assert (split.tenant.concurrent_requests, split.tenant.open_streams) == (3, None)
    assert split.key == limits.key  # key caps apply per cell


# -- review 3: what a forward sends and passes back --------------------------------------------


def _forward_through(path: str, raw_path: bytes, query: bytes = b""
                     ) -> tuple[list[httpx.Request], list[dict[str, Any]]]:
    """Run ``forward`` against a home cell answered in process; (requests it got, messages)."""
    seen: list[httpx.Request] = []

    def home(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, stream=httpx.ByteStream(b"{}"), headers=[
            ("set-cookie", "sessionid=home-cell; Path=/"), ("x-request-id", "r1")])

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def go() -> None:
        routing._client = httpx.AsyncClient(transport=httpx.MockTransport(home))
        try:
            scope = {"method": "GET", "path": path, "raw_path": raw_path,
                     "query_string": query, "headers": [(b"authorization", b"Bearer k")]}
            await routing.forward(scope, b"", routing.WrongCell("east", "http://east.example"),
                                  send)
        finally:
            await routing._client.aclose()
            routing._client = None

    asyncio.run(go())
    return seen, sent


def test_a_forward_keeps_the_path_encoded_and_drops_the_home_cells_cookie(two_cells) -> None:
    seen, sent = _forward_through("/v1/models/a?b", b"/v1/models/a%3Fb", b"x=1")
    assert seen[0].url.raw_path == b"/v1/models/a%3Fb?x=1"  # %3F stays in the path
    headers = dict(sent[0]["headers"])
    assert b"set-cookie" not in headers and headers[b"x-request-id"] == b"r1"


@pytest.mark.parametrize("path,raw", [
    ("/v1/models\r\nX-Injected: 1", b"/v1/models%0d%0aX-Injected:%201"),
    ("/v1/models\r\nX-Injected: 1", b"/v1/models\r\nX-Injected: 1"),
])
def test_a_control_character_in_a_forwarded_path_is_a_400(two_cells, path, raw) -> None:
    with pytest.raises(ApiError) as err:
        _forward_through(path, raw)
    assert (err.value.status, err.value.param) == (400, "path")
