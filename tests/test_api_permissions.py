"""Every management API endpoint against every seat: acme's owner, member and billing user, an
outsider (owner of another tenant), a platform staff account without permissions, and a
superuser; plus principals that must behave exactly like one of them (management tokens, staff
acting through a grant) and anonymous callers. A tenant the caller has no role in answers 404,
as if it did not exist; platform endpoints answer 403 without the Django permission."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission
from django.db import transaction
from django.utils import timezone
from rest_framework.test import APIClient

from catalog.models import Pool, Route, RouteTarget, ServedModel
from metering.billing.models import ExportJob, SpendAlert
from tenants.management_tokens import issue_token
from tenants.models import (
    ApiKey,
    Budget,
    Invitation,
    ManagementToken,
    Project,
    StaffGrant,
    TenantFallback,
)
from tests.worlds import build_world, make_user, this_hour

pytestmark = pytest.mark.django_db
T = "/api/tenants/acme"
EXPORT = {"start": "2026-11-01T00:00:00Z", "end": "2026-11-02T00:00:00Z", "format": "xlsx"}

# (method, path, body, expected status for each seat in ROLES)
ROLES = ("owner", "member", "billing", "outsider", "staff", "admin")
ENDPOINTS = [
    ("get", f"{T}/keys/", None, 200, 200, 403, 404, 404, 404),
    ("post", f"{T}/keys/", {"name": "new"}, 201, 201, 403, 404, 404, 404),
    ("get", f"{T}/keys/{{owner_key}}/", None, 200, 404, 403, 404, 404, 404),
    ("get", f"{T}/keys/{{member_key}}/", None, 200, 200, 403, 404, 404, 404),
    ("delete", f"{T}/keys/{{member_key}}/", None, 204, 204, 403, 404, 404, 404),
    ("post", f"{T}/keys/{{member_key}}/rotate/", {"grace_seconds": 60},
     201, 201, 403, 404, 404, 404),
    ("post", f"{T}/keys/{{member_key}}/resume/", None, 200, 403, 403, 404, 404, 404),
    ("get", f"{T}/projects/", None, 200, 200, 200, 404, 404, 404),
    ("post", f"{T}/projects/", {"name": "Production", "slug": "prod"},
     201, 403, 403, 404, 404, 404),
    ("get", f"{T}/projects/{{project}}/", None, 200, 200, 200, 404, 404, 404),
    ("patch", f"{T}/projects/{{project}}/", {"name": "Web"}, 200, 403, 403, 404, 404, 404),
    ("delete", f"{T}/projects/{{project}}/", None, 204, 403, 403, 404, 404, 404),
    ("get", f"{T}/budgets/", None, 200, 403, 200, 404, 404, 404),
    ("post", f"{T}/budgets/", {"level": "tenant", "metric": "tokens", "limit": "1000000",
                               "period": "day"}, 201, 403, 403, 404, 404, 404),
    ("get", f"{T}/budgets/{{budget}}/", None, 200, 403, 200, 404, 404, 404),
    ("get", f"{T}/budgets/export/", None, 200, 403, 200, 404, 404, 404),
    ("patch", f"{T}/budgets/{{budget}}/", {"limit": "20"}, 200, 403, 403, 404, 404, 404),
    ("delete", f"{T}/budgets/{{budget}}/", None, 204, 403, 403, 404, 404, 404),
    ("get", f"{T}/members/", None, 200, 403, 403, 404, 404, 404),
    ("get", f"{T}/members/{{billing_membership}}/", None, 200, 403, 403, 404, 404, 404),
    ("post", f"{T}/members/", {"user": "staff", "role": "member"}, 405, 403, 403, 404, 404, 404),
    ("patch", f"{T}/members/{{billing_membership}}/", {"role": "member"},
     200, 403, 403, 404, 404, 404),
    ("delete", f"{T}/members/{{billing_membership}}/", None, 204, 403, 403, 404, 404, 404),
    ("get", f"{T}/invitations/", None, 200, 403, 403, 404, 404, 404),
    ("post", f"{T}/invitations/", {"email": "new@example.test", "role": "member"},
     201, 403, 403, 404, 404, 404),
    ("get", f"{T}/invitations/{{invitation}}/", None, 200, 403, 403, 404, 404, 404),
    ("delete", f"{T}/invitations/{{invitation}}/", None, 204, 403, 403, 404, 404, 404),
    ("get", f"{T}/tokens/", None, 200, 403, 403, 404, 404, 404),
    ("get", f"{T}/tokens/{{token}}/", None, 200, 403, 403, 404, 404, 404),
    ("delete", f"{T}/tokens/{{token}}/", None, 204, 403, 403, 404, 404, 404),
    ("get", f"{T}/quotas/", None, 200, 200, 200, 404, 404, 404),
    ("get", f"{T}/quotas/effective/", None, 200, 200, 200, 404, 404, 404),
    ("patch", f"{T}/quotas/{{quota}}/", {"input_tpm": 1000, "input_burst": 9000},
     403, 403, 403, 404, 404, 200),
    ("get", f"{T}/usage/", None, 200, 200, 200, 404, 404, 404),
    ("get", f"{T}/rollups/", None, 200, 200, 200, 404, 404, 404),
    ("get", f"{T}/requests/", None, 200, 200, 200, 404, 404, 404),
    ("get", f"{T}/requests/?status=refused&code=rate_limit_exceeded", None,
     200, 200, 200, 404, 404, 404),
    ("get", f"{T}/reports/", None, 200, 403, 200, 404, 404, 404),
    ("get", f"{T}/reports/statements/2026-11/", None, 200, 403, 200, 404, 404, 404),
    ("get", f"{T}/exports/", None, 200, 403, 200, 404, 404, 404),
    ("post", f"{T}/exports/", EXPORT, 201, 403, 201, 404, 404, 404),
    ("get", f"{T}/exports/{{export}}/", None, 200, 403, 200, 404, 404, 404),
    ("get", f"{T}/exports/{{export}}/download/", None, 200, 403, 200, 404, 404, 404),
    ("get", f"{T}/alerts/", None, 200, 403, 200, 404, 404, 404),
    ("post", f"{T}/alerts/", {"metric": "tokens", "period": "day", "threshold": "10"},
     201, 403, 201, 404, 404, 404),
    ("get", f"{T}/alerts/{{alert}}/", None, 200, 403, 200, 404, 404, 404),
    ("patch", f"{T}/alerts/{{alert}}/", {"enabled": False}, 200, 403, 200, 404, 404, 404),
    ("delete", f"{T}/alerts/{{alert}}/", None, 204, 403, 204, 404, 404, 404),
    ("get", f"{T}/alerts/events/", None, 200, 403, 200, 404, 404, 404),
    ("get", f"{T}/content-logging/", None, 200, 403, 403, 404, 404, 404),
    ("put", f"{T}/content-logging/set/", {"enabled": True}, 200, 403, 403, 404, 404, 404),
    ("get", f"{T}/response-cache/", None, 200, 403, 403, 404, 404, 404),
    ("put", f"{T}/response-cache/set/", {"enabled": True}, 200, 403, 403, 404, 404, 404),
    ("get", f"{T}/fallbacks/", None, 200, 200, 403, 404, 404, 404),
    ("post", f"{T}/fallbacks/", {"model": "sim-other", "fallbacks": ["sim-small"]},
     201, 403, 403, 404, 404, 404),
    ("get", f"{T}/fallbacks/{{fallback}}/", None, 200, 200, 403, 404, 404, 404),
    ("patch", f"{T}/fallbacks/{{fallback}}/", {"fallbacks": ["sim-x"]},
     200, 403, 403, 404, 404, 404),
    ("delete", f"{T}/fallbacks/{{fallback}}/", None, 204, 403, 403, 404, 404, 404),
    ("get", "/api/tenants/", None, 403, 403, 403, 403, 403, 200),
    ("get", "/api/tenants/acme/", None, 403, 403, 403, 403, 403, 200),
    ("patch", "/api/tenants/acme/", {"status": "suspended"}, 403, 403, 403, 403, 403, 200),
    ("get", "/api/models/", None, 200, 200, 200, 200, 403, 200),
    ("get", "/api/models/sim-small/", None, 200, 200, 200, 200, 403, 200),
    ("post", "/api/models/", {"name": "m2", "engine_model_id": "m2"},
     403, 403, 403, 403, 403, 201),
    ("get", "/api/pools/", None, 200, 200, 200, 200, 403, 200),
    ("patch", "/api/pools/shared-small/", {"enabled": False}, 403, 403, 403, 403, 403, 200),
    ("get", "/api/prices/", None, 200, 200, 200, 200, 403, 200),
    ("get", "/api/routes/", None, 200, 200, 200, 200, 403, 200),
    ("get", "/api/routes/{route}/", None, 200, 200, 200, 200, 403, 200),
    ("post", "/api/routes/", {"name": "fast", "targets": [{"pool": "shared-small", "weight": 2}]},
     403, 403, 403, 403, 403, 201),
    ("patch", "/api/routes/{route}/", {"fallbacks": ["sim-small"]}, 403, 403, 403, 403, 403, 200),
    ("delete", "/api/routes/{route}/", None, 403, 403, 403, 403, 403, 204),
    ("post", "/api/prices/", {"model_name": "sim-small", "currency": "USD",
                              "input_per_mtok": "1", "cached_input_per_mtok": "0.5",
                              "output_per_mtok": "2", "effective_from": "2026-01-01T00:00:00Z"},
     403, 403, 403, 403, 403, 201),
    ("get", "/api/reports/usage/", None, 403, 403, 403, 403, 403, 200),
]
# Principals that must behave exactly like a seat above: tokens act with their own role in
# their own tenant; staff act with their grant's role; a lapsed grant is no grant.
ALIASES = {"token_billing": "billing", "token_other": "outsider",
           "granted_owner": "owner", "granted_billing": "billing", "grant_expired": "staff",
           "grant_revoked": "staff", "granted_but_not_staff": "staff"}


@pytest.fixture(scope="module")
def shared_world(django_db_setup, django_db_blocker, tmp_path_factory):
    """The world, built once for the module inside a transaction that is rolled back at its
    end: each test runs in a savepoint of it (pytest-django's ``django_db``) and rolls back to
    it, so every test still starts from this same state. The matrix is over a thousand tests:
    building the world for each was a third of the unit lane's time."""
    with django_db_blocker.unblock(), transaction.atomic():
        world = build_world()
        world.alert = SpendAlert.objects.create(tenant=world.tenant, threshold=10)
        done = tmp_path_factory.mktemp("exports") / "export.csv"
        done.write_text("tenant\n")
        world.export = ExportJob.objects.create(
            tenant=world.tenant, start=this_hour(), end=this_hour(), status="done",
            file_path=str(done))
        world.token, _ = issue_token(world.tenant, "ci", "owner",
                                     created_by=world.users["owner"])
        world.project = Project.objects.create(tenant=world.tenant, name="web", slug="web")
        world.budget = Budget.objects.create(tenant=world.tenant, level="tenant", limit=10)
        world.fallback = TenantFallback.objects.create(tenant=world.tenant, model="sim-small",
                                                       fallbacks=["sim-large"])
        world.route = Route.objects.create(name="chat-default", fallbacks=["sim-small"])
        RouteTarget.objects.create(route=world.route,
                                   pool=Pool.objects.get(name="shared-small"))
        world.invitation = Invitation.objects.create(
            tenant=world.tenant, email="x@example.test", secret_hash="0" * 64,
            expires_at=timezone.now() + timedelta(days=1))
        yield world
        transaction.set_rollback(True)


@pytest.fixture
def world(shared_world, redis_client):
    return shared_world


def _grant(world, name: str, role: str, *, is_staff: bool = True, **fields) -> object:
    user = make_user(name, is_staff=is_staff)
    fields.setdefault("expires_at", timezone.now() + timedelta(hours=1))
    StaffGrant.objects.create(user=user, tenant=world.tenant, role=role, reason="ticket 1",
                              **fields)
    return user


def _client(world, who: str) -> APIClient:
    client = APIClient()
    past = timezone.now() - timedelta(minutes=1)
    users = {
        "granted_owner": lambda: _grant(world, "support-o", "owner"),
        "granted_billing": lambda: _grant(world, "support-b", "billing"),
        "grant_expired": lambda: _grant(world, "support-x", "owner", expires_at=past),
        "grant_revoked": lambda: _grant(world, "support-r", "owner", revoked_at=past),
        "granted_but_not_staff": lambda: _grant(world, "ex-staff", "owner", is_staff=False),
    }
    if who == "token_billing":
        _, plaintext = issue_token(world.tenant, "ci", "billing", created_by=world.users["owner"])
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    elif who == "token_other":
        _, plaintext = issue_token(world.other, "ci", "owner",
                                   created_by=world.users["outsider"])
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    elif who in users:
        client.force_login(users[who]())
    elif who != "anonymous":
        client.force_login(world.users[who])
    return client


def _path(world, template: str) -> str:
    return template.format(
        owner_key=world.keys["owner"].id, member_key=world.keys["member"].id,
        billing_membership=world.tenant.memberships.get(role="billing").id,
        quota=world.tenant.quotas.get(model=None).id, alert=world.alert.id,
        export=world.export.id, invitation=world.invitation.id, token=world.token.id,
        project=world.project.id, budget=world.budget.id,
        fallback=world.fallback.id, route=world.route.id,
    )


# What a grant holder may not do although their grant's role may (review 3, N5): anything that
# would outlast the grant (a membership, an invitation, a key).
MINTS_LASTING_ACCESS = {
    ("post", f"{T}/keys/"), ("post", f"{T}/keys/{{member_key}}/rotate/"),
    ("patch", f"{T}/members/{{billing_membership}}/"),
    ("delete", f"{T}/members/{{billing_membership}}/"), ("post", f"{T}/invitations/"),
    ("put", f"{T}/content-logging/set/"),  # the tenant's own decision (N9)
    ("put", f"{T}/response-cache/set/"),  # stores answers: the tenant's decision too
}


def _expected(row, who: str) -> int:
    method, template, _, *codes = row
    if who == "anonymous":
        return 401
    if who == "granted_owner" and (method, template) in MINTS_LASTING_ACCESS:
        return 403
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


def test_every_routed_endpoint_is_in_the_matrix():
    """A new route without a row here fails: each must be tried from every seat."""
    from gateway.api import urls

    paths = {template for _, template, *_ in ENDPOINTS}
    for router, base in ((urls.scoped, f"{T}/"), (urls.platform, "/api/")):
        for prefix, _, _ in router.registry:
            assert any(p.startswith(f"{base}{prefix}/") for p in paths), prefix


def test_staff_without_permissions_cannot_mint_a_key_for_a_tenant(world):
    """The review's probe: a staff account with no permissions got 201 here, and the key
    served /v1."""
    response = _client(world, "staff").post(f"{T}/keys/", {"name": "mine"}, format="json")
    assert response.status_code == 404
    assert not ApiKey.objects.filter(name="mine").exists()


def test_a_platform_permission_allows_exactly_its_action(world):
    user = make_user("pool-operator", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="change_pool"))
    client = APIClient()
    client.force_login(user)
    assert client.patch("/api/pools/shared-small/", {"enabled": False},
                        format="json").status_code == 200
    assert Pool.objects.get(name="shared-small").enabled is False
    assert client.post("/api/models/", {"name": "m2", "engine_model_id": "m2"},
                       format="json").status_code == 403
    assert client.get("/api/tenants/").status_code == 403
    assert client.get(f"{T}/keys/").status_code == 404
    assert not ServedModel.objects.filter(name="m2").exists()
    user.is_active = False  # a deactivated operator keeps nothing
    user.save()
    assert client.patch("/api/pools/shared-small/", {"enabled": True},
                        format="json").status_code in (401, 403)


def test_a_grant_made_in_the_admin_is_on_record_and_cannot_be_deleted(world, client):
    support = make_user("support", is_staff=True)
    client.force_login(world.users["admin"])
    response = client.post("/admin/tenants/staffgrant/add/", {
        "user": support.pk, "tenant": world.tenant.pk, "role": "billing",
        "reason": "ticket 42: usage looks wrong", "expires_at_0": "2099-01-01",
        "expires_at_1": "00:00:00"})
    assert response.status_code == 302, response.content[:500]
    grant = StaffGrant.objects.get()
    assert grant.granted_by == world.users["admin"] and grant.user == support
    assert client.post(f"/admin/tenants/staffgrant/{grant.pk}/delete/", {"post": "yes"}) \
        .status_code == 403
    refused = client.post("/admin/tenants/staffgrant/add/", {
        "user": world.users["owner"].pk, "tenant": world.tenant.pk, "role": "owner",
        "reason": "x", "expires_at_0": "2099-01-01", "expires_at_1": "00:00:00"})
    assert refused.status_code == 200 and StaffGrant.objects.count() == 1  # not staff


def test_a_grant_cannot_become_a_lasting_owner(world):
    """The review's escalation path: as a grant holder, invite yourself as owner, accept, let
    the grant be revoked; the membership and keys minted under the grant used to stay."""
    support = _grant(world, "support", "owner")
    client = APIClient()
    client.force_login(support)
    invited = client.post(f"{T}/invitations/", {"email": support.email, "role": "owner"},
                          format="json")
    assert invited.status_code == 403 and "grant" in invited.json()["error"]["message"]
    assert not Invitation.objects.filter(email=support.email).exists()
    assert client.post(f"{T}/keys/", {"name": "mine"}, format="json").status_code == 403
    assert not ApiKey.objects.filter(name="mine").exists()
    billing = world.tenant.memberships.get(role="billing")
    assert client.patch(f"{T}/members/{billing.pk}/", {"role": "owner"},
                        format="json").status_code == 403
    assert world.tenant.memberships.get(pk=billing.pk).role == "billing"
    # What a grant is for still works: reading, and revoking a key.
    assert client.get(f"{T}/keys/").status_code == 200
    assert client.delete(f"{T}/keys/{world.keys['member'].id}/").status_code == 204


def test_only_the_tenants_owner_switches_content_logging(world, client):
    """Review 3, N9: staff turned a tenant's content logging on with PATCH /api/tenants/<t>/
    and in the admin's tenant form, without the tenant and without an audit row."""
    from tenants.models import ContentLoggingChange, Tenant

    admin = _client(world, "admin")
    patched = admin.patch("/api/tenants/acme/", {"content_logging": True}, format="json")
    assert patched.status_code == 400 and patched.json()["error"]["param"] == "content_logging"
    client.force_login(world.users["admin"])
    form = client.get(f"/admin/tenants/tenant/{world.tenant.pk}/change/").content.decode()
    assert 'name="content_logging"' not in form
    client.post(f"/admin/tenants/tenant/{world.tenant.pk}/change/", {
        "name": "acme", "slug": "acme", "status": "active", "region": "local",
        "content_logging": "on"})
    granted = _client(world, "granted_owner")
    assert granted.put(f"{T}/content-logging/set/", {"enabled": True},
                       format="json").status_code == 403
    assert Tenant.objects.get(pk=world.tenant.pk).content_logging is False
    assert not ContentLoggingChange.objects.exists()
    owner = _client(world, "owner")
    assert owner.put(f"{T}/content-logging/set/", {"enabled": True},
                     format="json").status_code == 200
    assert ContentLoggingChange.objects.get().changed_by == world.users["owner"]



def test_only_the_tenants_owner_switches_the_response_cache(world, client):
    """The cache keeps answers: staff switch it neither in the admin nor under a grant."""
    from tenants.models import ContentLoggingChange, Tenant

    client.force_login(world.users["admin"])
    form = client.get(f"/admin/tenants/tenant/{world.tenant.pk}/change/").content.decode()
    assert 'name="response_cache"' not in form
    granted = _client(world, "granted_owner")
    assert granted.put(f"{T}/response-cache/set/", {"enabled": True},
                       format="json").status_code == 403
    assert Tenant.objects.get(pk=world.tenant.pk).response_cache is False
    owner = _client(world, "owner")
    body = owner.put(f"{T}/response-cache/set/", {"enabled": True}, format="json").json()
    assert body["enabled"] is True and len(body["changes"]) == 1
    assert owner.put(f"{T}/response-cache/set/", {"enabled": "maybe"},
                     format="json").status_code == 400
    assert owner.get(f"{T}/content-logging/").json()["changes"] == []  # its own trail
    row = ContentLoggingChange.objects.get()
    assert (row.setting, row.changed_by) == ("response_cache", world.users["owner"])


def test_a_grant_reaches_its_tenant_only(world):
    client = APIClient()
    client.force_login(_grant(world, "support", "owner"))
    assert client.get(f"{T}/keys/").status_code == 200
    assert client.get("/api/tenants/other/keys/").status_code == 404
    assert client.get("/api/tenants/").status_code == 403


def test_a_token_never_reaches_another_tenant_even_if_its_creator_could(world):
    """An acme owner token whose maker is a superuser and an owner of ``other`` too is neither
    staff nor in ``other``."""
    maker = world.users["owner"]
    maker.is_staff = maker.is_superuser = True
    maker.save()
    world.other.memberships.create(user=maker, role="owner")
    _, plaintext = issue_token(world.tenant, "ci", "owner", created_by=maker)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert client.get("/api/tenants/other/keys/").status_code == 404
    assert client.get("/api/tenants/").status_code == 403
    assert client.get("/api/models/").json()["results"][0].keys() == \
        {"name", "max_model_len", "created_at"}
    assert client.get("/api/tenants/acme/keys/").status_code == 200


def test_bad_revoked_or_expired_tokens_are_401(world):
    token, plaintext = issue_token(world.tenant, "ci", "owner", created_by=world.users["owner"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext[:-1]}x")
    assert client.get("/api/tenants/acme/keys/").status_code == 401
    ManagementToken.objects.filter(pk=token.pk).update(revoked_at=timezone.now())
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert client.get("/api/tenants/acme/keys/").status_code == 401
    token, plaintext = issue_token(world.tenant, "ci", "owner", created_by=world.users["owner"])
    ManagementToken.objects.filter(pk=token.pk).update(expires_at=timezone.now())
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert client.get("/api/tenants/acme/keys/").status_code == 401


def test_pools_dedicated_to_another_tenant_stay_hidden(world):
    from tests.factories import make_pool

    make_pool(world.model, name="other-only", dedicated_to=world.other)
    client = _client(world, "owner")
    pools = client.get("/api/pools/").json()["results"]
    assert [p["name"] for p in pools] == ["shared-small"]
    assert "backend_settings" not in pools[0]  # may hold upstream credentials
    assert client.get("/api/pools/other-only/").status_code == 404
