"""Tenant isolation, endpoint family by endpoint family, with the owner / member / outsider trio
of ``tests.worlds`` (acme's owner and member; ``other``'s owner as the outsider),
plus the billing seat and platform staff (without permissions, and a superuser) where they
apply: staff have no tenant role anywhere without a grant.

What already covers what (not repeated here):
- management API, every endpoint x role, status codes: ``test_api_permissions``
- portal pages per role, tenant switch refused: ``test_portal_views`` (first two tests)
- admin refused to a non-staff user: ``test_admin::test_non_staff_cannot_reach_the_admin``
- break-glass permissions and per-tenant keys: ``test_breakglass``, ``test_contentlog_isolation``
- inference: another tenant's Last-Event-ID is 404 (``test_inference_live::test_resume_...``),
  idempotency keys are per tenant (``test_idempotency_key_replays_...``), tenant headers are
  ignored (``test_tenant_headers_are_ignored``), content logged only for opted-in tenants.

Added here: objects addressed by id across tenants (IDOR) in the portal, the contents (not just
the status) of usage / rollups / keys answers, every admin and break-glass page for the trio,
/metrics behind its token, and live: the prefix-cache salt (a repeat prompt is cached for its
tenant, never for another), Last-Event-ID and models for the trio.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from catalog.models import Pool
from metering.billing.models import ExportJob, SpendAlert
from tenants.auth import clear_cache
from tenants.management_tokens import issue_token
from tenants.models import ApiKey, Invitation, ManagementToken, Membership
from tenants.salts import cache_salt, platform_salt
from tests import procs
from tests.factories import make_model
from tests.live_pool import SERVER_ENV, ensure_pools, sse_events
from tests.worlds import build_world, record, roll_up, this_hour

TRIO = ("owner", "member", "outsider")


@pytest.fixture
def world(redis_client, tmp_path):
    clear_cache()
    world = build_world()
    world.alert = SpendAlert.objects.create(tenant=world.tenant, threshold=10)
    done = tmp_path / "acme.csv"
    done.write_text("acme secret row\n")
    world.export = ExportJob.objects.create(tenant=world.tenant, start=this_hour(),
                                            end=this_hour(), status="done", file_path=str(done))
    world.token, _ = issue_token(world.tenant, "ci", "owner", created_by=world.users["owner"])
    world.invitation = Invitation.objects.create(
        tenant=world.tenant, email="x@example.test", secret_hash="1" * 64,
        expires_at=timezone.now() + timedelta(days=1))
    now = timezone.now()
    world.records = [record(world.tenant, world.keys["owner"], "sim-small", now),
                     record(world.tenant, world.keys["member"], "sim-small", now),
                     record(world.other, world.keys["other"], "sim-small", now)]
    roll_up(*world.records)
    return world


def _signed_in(world, who: str) -> Client:
    client = Client()
    client.force_login(world.users[who])
    return client


# -- portal: acme's objects by id, from every seat -------------------------------------------


def _portal_targets(world) -> list[tuple[str, str, dict[str, Any], Any]]:
    """(method, url, form, check that the object is untouched) for each acme object."""
    owner_key, member_ship = world.keys["owner"], world.tenant.memberships.get(role="member")
    return [
        ("post", reverse("portal:key_revoke", args=[owner_key.pk]), {},
         lambda: ApiKey.objects.get(pk=owner_key.pk).revoked_at is None),
        ("post", reverse("portal:key_rotate", args=[owner_key.pk]), {"grace_seconds": 0},
         lambda: ApiKey.objects.filter(tenant=world.tenant).count() == 2),
        ("post", reverse("portal:alert_delete", args=[world.alert.pk]), {},
         lambda: SpendAlert.objects.filter(pk=world.alert.pk).exists()),
        ("post", reverse("portal:member_change", args=[member_ship.pk]), {"role": "owner"},
         lambda: Membership.objects.get(pk=member_ship.pk).role == "member"),
        ("post", reverse("portal:token_revoke", args=[world.token.pk]), {},
         lambda: ManagementToken.objects.get(pk=world.token.pk).revoked_at is None),
        ("post", reverse("portal:invitation_revoke", args=[world.invitation.pk]), {},
         lambda: Invitation.objects.get(pk=world.invitation.pk).revoked_at is None),
        ("get", reverse("portal:export_download", args=[world.export.pk]), {}, lambda: True),
        ("get", reverse("portal:export_status", args=[world.export.pk]), {}, lambda: True),
    ]


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["outsider", "staff", "admin"])
def test_portal_outsider_cannot_touch_acme_objects_by_id(world, who: str) -> None:
    """Another tenant's owner gets 404; platform staff, even a superuser, have no portal tenant
    and are sent to the no-tenant page."""
    client = _signed_in(world, who)
    for method, url, form, untouched in _portal_targets(world):
        response = getattr(client, method)(url, form)
        if who == "outsider":
            assert response.status_code == 404, (url, response.status_code)
        else:
            assert response.status_code == 302, (url, response.status_code)
            assert response["Location"] == reverse("portal:no_tenant")
        assert b"acme secret row" not in response.content and untouched(), url


@pytest.mark.django_db
def test_portal_member_is_refused_owner_actions_and_owner_may(world) -> None:
    member, owner = _signed_in(world, "member"), _signed_in(world, "owner")
    ship = world.tenant.memberships.get(role="billing")
    url = reverse("portal:member_change", args=[ship.pk])
    assert member.post(url, {"role": "owner"}).status_code == 403
    assert Membership.objects.get(pk=ship.pk).role == "billing"
    assert member.post(reverse("portal:token_revoke", args=[world.token.pk])).status_code == 403
    assert owner.post(url, {"role": "member"}).status_code in (200, 302)
    assert Membership.objects.get(pk=ship.pk).role == "member"
    # The member sees the tenant's usage page, but nothing of the other tenant.
    page = member.get(reverse("portal:keys")).content.decode()
    assert "member key" in page and "other key" not in page


# -- management API: what the answers contain ------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("who", TRIO)
def test_api_lists_hold_only_the_callers_tenant(world, who: str) -> None:
    client = _signed_in(world, who)
    mine = world.other if who == "outsider" else world.tenant
    theirs = world.tenant if who == "outsider" else world.other
    for path in ("usage/", "rollups/", "keys/"):
        rows = client.get(f"/api/tenants/{mine.slug}/{path}").json()["results"]
        assert rows, path
        text = str(rows)
        assert theirs.slug not in text
        request_ids = {r.get("request_id") for r in rows}
        assert not request_ids & {r.request_id for r in world.records if r.tenant_id == theirs.pk}
        key_ids = {r.get("api_key") or r.get("id") for r in rows} - {None}
        assert not key_ids & set(ApiKey.objects.filter(tenant=theirs).values_list("pk",
                                                                                  flat=True))
        assert client.get(f"/api/tenants/{theirs.slug}/{path}").status_code == 404
    # A filter naming the other tenant's key finds nothing rather than its records.
    other_key = ApiKey.objects.filter(tenant=theirs).first()
    rows = client.get(f"/api/tenants/{mine.slug}/usage/", {"key": other_key.pk})
    assert rows.status_code in (200, 400)
    if rows.status_code == 200:
        assert rows.json()["results"] == []


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["staff", "admin"])
def test_api_gives_staff_no_tenant_without_a_grant(world, who: str) -> None:
    """Platform staff, with no permission or with all of them, see no tenant's data."""
    client = _signed_in(world, who)
    for tenant in (world.tenant, world.other):
        for path in ("usage/", "rollups/", "keys/", "members/", "tokens/", "alerts/",
                     "exports/", "reports/", "content-logging/"):
            response = client.get(f"/api/tenants/{tenant.slug}/{path}")
            assert response.status_code == 404, (path, response.status_code)
            assert b"owner key" not in response.content


# -- admin and break-glass: nothing for tenant users -----------------------------------------

ADMIN_PAGES = ["/admin/", "/admin/tenants/apikey/", "/admin/tenants/tenant/",
               "/admin/metering/usagerecord/", "/admin/contentlog/contentrecord/",
               "/admin/tenants/managementtoken/", "/admin/tenants/staffgrant/"]


@pytest.mark.django_db
@pytest.mark.parametrize("who", [*TRIO, "billing", "staff"])
def test_admin_and_breakglass_refuse_every_tenant_seat(world, who: str) -> None:
    """Tenant seats are sent to the admin's sign-in; a staff account without permissions gets
    the admin's index and 403 on every model page."""
    client = _signed_in(world, who)
    for url in [*ADMIN_PAGES, f"/admin/tenants/apikey/{world.keys['owner'].pk}/change/"]:
        response = client.get(url)
        if who == "staff":
            assert response.status_code == (200 if url == "/admin/" else 403), url
            assert b"owner key" not in response.content
        else:
            assert response.status_code == 302 and "/admin/login/" in response["Location"], url
    for url in ("/breakglass/", "/breakglass/1/read/"):
        response = client.get(url)
        assert response.status_code in (302, 403, 404), url
        assert response.status_code != 200
    response = client.post("/breakglass/", {"tenant": world.tenant.pk, "reason": "curious",
                                            "minutes": 30})
    assert response.status_code in (302, 403)
    from gateway.contentlog.models import BreakGlassGrant

    assert not BreakGlassGrant.objects.exists()


def test_cache_salts_differ_per_tenant_and_from_the_platform() -> None:
    salts = {cache_salt(t) for t in range(1, 200)}
    assert len(salts) == 199 and platform_salt() not in salts
    assert cache_salt(7) == cache_salt(7)  # stable: every process and worker agrees


# -- live: inference and /metrics ------------------------------------------------------------

METRICS_TOKEN = "metrics-secret-for-tests"
POOL, MODEL = "live-pool", "sim-live"
LONG = [{"role": "user", "content": "Tell me about the weather in a long sentence. " * 12}]


@pytest.fixture(scope="module")
def system(live_system) -> dict[str, Any]:
    return live_system(pool=POOL, worker_ids=["iso-w1"], prepare=ensure_pools,
                       env={**SERVER_ENV, "METRICS_TOKEN": METRICS_TOKEN})


@pytest.fixture
def live(system, redis_client) -> dict[str, Any]:
    ensure_pools()
    procs.wait_for_worker(redis_client, POOL, "iso-w1", system["worker"], timeout=10)
    clear_cache()
    return {**system, "world": build_world()}


def _post(live, who: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    plain = live["world"].plaintexts["other" if who == "outsider" else who]
    return httpx.post(live["url"] + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {plain}", **headers})


def _cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
def test_prefix_cache_is_shared_within_a_tenant_never_across(live) -> None:
    body = {"model": MODEL, "messages": LONG, "max_tokens": 2}
    assert _cached(_post(live, "owner", body)) == 0
    again = _cached(_post(live, "owner", body))
    assert again > 0  # the same tenant hits its own cached prefix ...
    assert _cached(_post(live, "member", body)) > 0  # ... from any of its keys
    assert _cached(_post(live, "outsider", body)) == 0  # another tenant never does
    assert _cached(_post(live, "outsider", body)) > 0  # (it builds its own)


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
def test_a_shared_prompt_cache_key_never_crosses_tenants(live) -> None:
    """``prompt_cache_key`` is a hint inside the tenant's own cache scope (I1): another tenant
    sending the same key and prompt gets nothing from this tenant's cache."""
    prompt = [{"role": "user", "content": "Describe the harbour at dawn, slowly. " * 12}]
    body = {"model": MODEL, "messages": prompt, "max_tokens": 2, "prompt_cache_key": "shared"}
    assert _cached(_post(live, "owner", body)) == 0
    assert _cached(_post(live, "owner", body)) > 0
    assert _cached(_post(live, "outsider", body)) == 0


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
def test_resume_and_models_for_the_trio(live) -> None:
    world = live["world"]
    Pool.objects.create(name="other-only", model=world.model, dedicated_to=world.other)
    stream = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": 6, "stream": True}
    text = _post(live, "owner", stream).text
    last = sse_events(text)[1].splitlines()[0][4:]
    for who, status in (("owner", 200), ("member", 200), ("outsider", 404)):
        r = _post(live, who, stream, **{"Last-Event-ID": last})
        assert r.status_code == status, (who, r.text[:200])
        if status == 404:
            assert r.json()["error"]["code"] == "stream_not_found"
            assert "data:" not in r.text  # not one event of the owner's stream
    for who in TRIO:
        plain = world.plaintexts["other" if who == "outsider" else who]
        names = {m["id"] for m in httpx.get(live["url"] + "/v1/models", timeout=10, headers={
            "Authorization": f"Bearer {plain}"}).json()["data"]}
        assert MODEL in names


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
def test_another_tenants_private_model_is_unknown_on_v1(live) -> None:
    """Before: 503 ``no_pool``, which confirmed the model exists."""
    world = live["world"]
    Pool.objects.create(name="private-pool", model=make_model("sim-private"),
                        dedicated_to=world.other)

    def listed_for_other() -> bool:
        body = httpx.get(live["url"] + "/v1/models", timeout=10, headers={
            "Authorization": f"Bearer {world.plaintexts['other']}"}).json()
        return "sim-private" in {m["id"] for m in body["data"]}

    with procs.wedged_worker("private-pool", "private-w"):  # listed only while served
        procs.wait_until(listed_for_other, 10, "the gateway to read the new pool")
    answers = []
    for model in ("sim-private", "no-such-model"):
        r = _post(live, "owner", {"model": model, "messages": LONG, "max_tokens": 1})
        error = r.json()["error"]
        answers.append((r.status_code, error["code"], error["message"].replace(model, "M")))
    assert answers[0] == answers[1] and answers[0][0] == 404
    r = httpx.get(live["url"] + "/v1/models/sim-private", timeout=10, headers={
        "Authorization": f"Bearer {world.plaintexts['owner']}"})
    assert r.status_code == 404


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
def test_metrics_need_the_metrics_token_not_a_tenant_credential(live) -> None:
    world = live["world"]
    _, mgmt = issue_token(world.tenant, "ci", "owner", created_by=world.users["owner"])
    url = live["url"] + "/metrics"
    for credential in [*(world.plaintexts[k] for k in ("owner", "member", "other")), mgmt, None]:
        auth = {"Authorization": f"Bearer {credential}"} if credential else {}
        r = httpx.get(url, timeout=10, headers=auth)
        assert r.status_code == 401 and "igw_" not in r.text
    ok = httpx.get(url, timeout=10, headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert ok.status_code == 200 and "igw_" in ok.text


def _metrics_status(client: tuple[str, int] | None, settings, token: str = "",
                    auth: bytes | None = None) -> int:
    from asgiref.testing import ApplicationCommunicator

    from gateway.inference import consumers

    settings.METRICS_TOKEN = token
    scope = {"type": "http", "method": "GET", "path": "/metrics", "query_string": b"",
             "headers": [(b"authorization", auth)] if auth else [], "client": client}

    async def go() -> int:
        comm = ApplicationCommunicator(consumers.MetricsConsumer.as_asgi(), scope)
        await comm.send_input({"type": "http.request", "body": b""})
        start = await comm.receive_output(10)
        await comm.wait(10)
        return start["status"]

    return procs.arun(go())


@pytest.mark.django_db
def test_metrics_without_a_token_answer_only_this_host(redis_client, settings) -> None:
    """The labels name every tenant: with no METRICS_TOKEN, a remote peer (a tenant, anyone)
    is refused; the host's own scraper still reads them."""
    assert _metrics_status(("10.1.2.3", 5555), settings) == 403
    assert _metrics_status(("2001:db8::1", 5555), settings) == 403
    assert _metrics_status(("127.0.0.1", 5555), settings) == 200
    assert _metrics_status(("10.1.2.3", 5555), settings, token="t",
                           auth=b"Bearer t") == 200
    assert _metrics_status(("127.0.0.1", 5555), settings, token="t",
                           auth=b"Bearer x") == 401
