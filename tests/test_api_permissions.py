"""Every management API endpoint against the owner / member / billing / outsider / staff set,
plus management tokens (acme's billing token acts as billing; another tenant's token is an
outsider) and anonymous callers. An outsider gets 404: other tenants' slugs do not leak."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from gateway.portal.tokens import issue_token
from metering.billing.models import ExportJob, SpendAlert
from tests.worlds import build_world, this_hour

pytestmark = pytest.mark.django_db
T = "/api/tenants/acme"

# (method, path, body, expected status for owner, member, billing, outsider, staff)
ENDPOINTS = [
    ("get", f"{T}/keys/", None, 200, 200, 403, 404, 200),
    ("post", f"{T}/keys/", {"name": "new"}, 201, 201, 403, 404, 201),
    ("get", f"{T}/keys/{{owner_key}}/", None, 200, 404, 403, 404, 200),
    ("get", f"{T}/keys/{{member_key}}/", None, 200, 200, 403, 404, 200),
    ("delete", f"{T}/keys/{{member_key}}/", None, 204, 204, 403, 404, 204),
    ("post", f"{T}/keys/{{member_key}}/rotate/", {"grace_seconds": 60}, 201, 201, 403, 404, 201),
    ("get", f"{T}/members/", None, 200, 403, 403, 404, 200),
    ("post", f"{T}/members/", {"user": "staff", "role": "member"}, 201, 403, 403, 404, 201),
    ("patch", f"{T}/members/{{billing_membership}}/", {"role": "member"}, 200, 403, 403, 404,
     200),
    ("get", f"{T}/quotas/", None, 200, 200, 200, 404, 200),
    ("get", f"{T}/quotas/effective/", None, 200, 200, 200, 404, 200),
    ("patch", f"{T}/quotas/{{quota}}/", {"input_tpm": 1000, "input_burst": 9000}, 403, 403, 403,
     404, 200),
    ("get", f"{T}/usage/", None, 200, 200, 200, 404, 200),
    ("get", f"{T}/rollups/", None, 200, 200, 200, 404, 200),
    ("get", f"{T}/reports/", None, 200, 403, 200, 404, 200),
    ("get", f"{T}/reports/statements/2026-11/", None, 200, 403, 200, 404, 200),
    ("get", f"{T}/exports/", None, 200, 403, 200, 404, 200),
    ("post", f"{T}/exports/", {"start": "2026-11-01T00:00:00Z", "end": "2026-11-02T00:00:00Z",
                               "format": "xlsx"}, 201, 403, 201, 404, 201),
    ("get", f"{T}/exports/{{export}}/", None, 200, 403, 200, 404, 200),
    ("get", f"{T}/exports/{{export}}/download/", None, 200, 403, 200, 404, 200),
    ("get", f"{T}/alerts/{{alert}}/", None, 200, 403, 200, 404, 200),
    ("patch", f"{T}/alerts/{{alert}}/", {"enabled": False}, 200, 403, 200, 404, 200),
    ("delete", f"{T}/alerts/{{alert}}/", None, 204, 403, 204, 404, 204),
    ("delete", f"{T}/members/{{billing_membership}}/", None, 204, 403, 403, 404, 204),
    ("get", f"{T}/alerts/", None, 200, 403, 200, 404, 200),
    ("post", f"{T}/alerts/", {"metric": "tokens", "period": "day", "threshold": "10"},
     201, 403, 201, 404, 201),
    ("get", f"{T}/alerts/events/", None, 200, 403, 200, 404, 200),
    ("get", f"{T}/content-logging/", None, 200, 403, 403, 404, 200),
    ("put", f"{T}/content-logging/set/", {"enabled": True}, 200, 403, 403, 404, 200),
    ("get", "/api/tenants/", None, 403, 403, 403, 403, 200),
    ("get", "/api/tenants/acme/", None, 403, 403, 403, 403, 200),
    ("get", "/api/models/", None, 200, 200, 200, 200, 200),
    ("post", "/api/models/", {"name": "m2", "engine_model_id": "m2"}, 403, 403, 403, 403, 201),
    ("get", "/api/pools/", None, 200, 200, 200, 200, 200),
    ("patch", "/api/pools/shared-small/", {"enabled": False}, 403, 403, 403, 403, 200),
    ("get", "/api/prices/", None, 200, 200, 200, 200, 200),
    ("get", "/api/reports/usage/", None, 403, 403, 403, 403, 200),
]
ROLES = ("owner", "member", "billing", "outsider", "staff")
# Principals that must behave exactly like a role above.
ALIASES = {"token_billing": "billing", "token_other": "outsider"}


@pytest.fixture
def world(redis_client, tmp_path):
    world = build_world()
    world.alert = SpendAlert.objects.create(tenant=world.tenant, threshold=10)
    done = tmp_path / "export.csv"
    done.write_text("tenant\n")
    world.export = ExportJob.objects.create(
        tenant=world.tenant, start=this_hour(), end=this_hour(), status="done",
        file_path=str(done))
    return world


def _client(world, who: str) -> APIClient:
    client = APIClient()
    if who == "token_billing":
        _, plaintext = issue_token(world.tenant, "ci", "billing")
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    elif who == "token_other":
        _, plaintext = issue_token(world.other, "ci", "owner")
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    elif who != "anonymous":
        client.force_login(world.users[who])
    return client


def _path(world, template: str) -> str:
    return template.format(
        owner_key=world.keys["owner"].id, member_key=world.keys["member"].id,
        billing_membership=world.tenant.memberships.get(role="billing").id,
        quota=world.tenant.quotas.get(model=None).id, alert=world.alert.id,
        export=world.export.id,
    )


def _expected(row, who: str) -> int:
    _, _, _, *codes = row
    if who == "anonymous":
        return 401
    return codes[ROLES.index(ALIASES.get(who, who))]


@pytest.mark.parametrize("who", [*ROLES, *ALIASES, "anonymous"])
@pytest.mark.parametrize("row", ENDPOINTS, ids=[f"{r[0]} {r[1]}" for r in ENDPOINTS])
def test_endpoint_permissions(world, row, who):
    method, template, body, *_ = row
    response = getattr(_client(world, who), method)(_path(world, template), body, format="json")
    assert response.status_code == _expected(row, who), response.content[:300]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}


def test_a_token_never_reaches_another_tenant_even_if_its_creator_could(world):
    """An acme owner token made by a staff user is not staff and cannot read other's keys."""
    _, plaintext = issue_token(world.tenant, "ci", "owner", created_by=world.users["staff"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert client.get("/api/tenants/other/keys/").status_code == 404
    assert client.get("/api/tenants/").status_code == 403
    assert client.get("/api/tenants/acme/keys/").status_code == 200


def test_bad_revoked_or_expired_tokens_are_401(world):
    token, plaintext = issue_token(world.tenant, "ci", "owner")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext[:-1]}x")
    assert client.get("/api/tenants/acme/keys/").status_code == 401
    from django.utils import timezone

    type(token).objects.filter(pk=token.pk).update(revoked_at=timezone.now())
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert client.get("/api/tenants/acme/keys/").status_code == 401


def test_pools_dedicated_to_another_tenant_stay_hidden(world):
    from tests.factories import make_pool

    make_pool(world.model, name="other-only", dedicated_to=world.other)
    client = _client(world, "owner")
    names = [p["name"] for p in client.get("/api/pools/").json()["results"]]
    assert names == ["shared-small"]
    assert client.get("/api/pools/other-only/").status_code == 404
