"""What the management API does: keys shown once and revoked for real, rotation with grace,
limits validated, usage filtered and scoped, reports in three formats, the OpenAPI schema."""

from __future__ import annotations

import csv
import io
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from tenants.auth import AuthError, authenticate, clear_cache
from tenants.models import ApiKey
from tests.factories import bearer
from tests.worlds import build_world, record, roll_up, this_hour

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(redis_client):
    clear_cache()
    return build_world()


def client_for(world, who):
    client = APIClient()
    client.force_login(world.users[who])
    return client


def test_created_key_is_returned_once_and_authenticates(world):
    client = client_for(world, "member")
    response = client.post("/api/tenants/acme/keys/",
                           {"name": "ci", "allowed_models": ["sim-small"], "input_tpm": 1000},
                           format="json")
    assert response.status_code == 201 and response["Cache-Control"] == "no-store"
    body = response.json()
    principal = authenticate(bearer(body["key"]))
    assert principal.tenant_id == world.tenant.id and principal.key_id == body["id"]
    again = client.get(f"/api/tenants/acme/keys/{body['id']}/").json()
    assert "key" not in again and again["last_four"] == body["key"][-4:]
    assert ApiKey.objects.get(pk=body["id"]).created_by == world.users["member"]


def test_revoked_key_stops_authenticating(world):
    plaintext = world.plaintexts["member"]
    authenticate(bearer(plaintext))
    response = client_for(world, "member").delete(
        f"/api/tenants/acme/keys/{world.keys['member'].id}/")
    assert response.status_code == 204
    with pytest.raises(AuthError):
        authenticate(bearer(plaintext))


def test_rotation_keeps_the_old_key_for_the_grace_period(world):
    old = world.keys["owner"]
    response = client_for(world, "owner").post(
        f"/api/tenants/acme/keys/{old.id}/rotate/", {"grace_seconds": 3600}, format="json")
    assert response.status_code == 201
    old.refresh_from_db()
    assert timedelta(minutes=59) < old.expires_at - timezone.now() <= timedelta(hours=1)
    assert authenticate(bearer(world.plaintexts["owner"])).key_id == old.id
    assert authenticate(bearer(response.json()["key"])).key_id == response.json()["id"]


def test_key_caps_above_the_tenant_are_refused_in_openai_shape(world):
    response = client_for(world, "owner").post(
        "/api/tenants/acme/keys/", {"name": "x", "output_tpm": 10**9}, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "output_tpm" and "above the tenant" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_model_of_another_tenant_cannot_be_allowed(world):
    from tests.factories import make_model, make_pool

    make_pool(make_model("private"), name="private-pool", dedicated_to=world.other)
    response = client_for(world, "owner").post(
        "/api/tenants/acme/keys/", {"name": "x", "allowed_models": ["private"]}, format="json")
    assert response.status_code == 400 and response.json()["error"]["param"] == "allowed_models"
    # Review 3, old finding 8: exactly the answer for a model that does not exist.
    unknown = client_for(world, "owner").post(
        "/api/tenants/acme/keys/", {"name": "x", "allowed_models": ["private"[::-1]]},
        format="json")
    assert unknown.status_code == 400
    assert response.json()["error"]["message"].replace("private", "?") == \
        unknown.json()["error"]["message"].replace("private"[::-1], "?")


def test_prices_do_not_list_another_tenants_dedicated_model(world):
    from metering.billing.models import Price
    from tests.factories import make_model, make_pool

    make_pool(make_model("private"), name="private-pool", dedicated_to=world.other)
    for name in ("private", "sim-small"):
        Price.objects.create(model_name=name, input_per_mtok=1, cached_input_per_mtok=1,
                             output_per_mtok=1)
    listed = {p["model_name"] for p in client_for(world, "owner").get("/api/prices/").json()[
        "results"]}
    assert "sim-small" in listed and "private" not in listed
    outsider = {p["model_name"] for p in client_for(world, "outsider").get(
        "/api/prices/").json()["results"]}
    assert "private" in outsider  # its own tenant's model


def test_the_last_owner_stays(world):
    client = client_for(world, "owner")
    mine = world.tenant.memberships.get(role="owner")
    assert client.delete(f"/api/tenants/acme/members/{mine.id}/").status_code == 400
    assert client.patch(f"/api/tenants/acme/members/{mine.id}/", {"role": "member"},
                        format="json").status_code == 400


def test_usage_is_filtered_by_time_model_and_key_and_scoped_for_members(world):
    now = this_hour()
    owner_key, member_key = world.keys["owner"], world.keys["member"]
    rows = [
        record(world.tenant, owner_key, "sim-small", now - timedelta(hours=5)),
        record(world.tenant, member_key, "sim-small", now - timedelta(hours=1)),
        record(world.tenant, member_key, "sim-large", now - timedelta(minutes=10)),
        record(world.other, world.keys["other"], "sim-small", now - timedelta(minutes=5)),
    ]
    roll_up(*rows)
    owner = client_for(world, "owner")

    def ids(client, query=""):
        body = client.get(f"/api/tenants/acme/usage/{query}").json()
        return {r["request_id"] for r in body["results"]}

    assert ids(owner) == {r.request_id for r in rows[:3]}
    start = (now - timedelta(hours=2)).isoformat().replace("+00:00", "Z")
    assert ids(owner, f"?start={start}") == {rows[1].request_id, rows[2].request_id}
    assert ids(owner, "?model=sim-large") == {rows[2].request_id}
    assert ids(owner, f"?key={owner_key.id}") == {rows[0].request_id}
    assert ids(client_for(world, "member")) == {rows[1].request_id, rows[2].request_id}
    bad = owner.get("/api/tenants/acme/usage/?start=yesterday")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "start"
    rollups = owner.get("/api/tenants/acme/rollups/?model=sim-small").json()["results"]
    assert sum(r["requests"] for r in rollups) == 2


def test_usage_pages_with_a_cursor(world):
    now = this_hour()
    for i in range(7):
        record(world.tenant, world.keys["owner"], "sim-small", now - timedelta(minutes=i))
    client, seen, url = client_for(world, "owner"), [], "/api/tenants/acme/usage/?limit=3"
    while url:
        body = client.get(url).json()
        seen += [r["request_id"] for r in body["results"]]
        url = body["next"]
    assert len(seen) == len(set(seen)) == 7


def test_report_formats(world):
    now = this_hour()
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", now, prompt=7, completion=3))
    client = client_for(world, "billing")
    start = (now - timedelta(hours=1)).date().isoformat()
    body = client.get(f"/api/tenants/acme/reports/?start={start}&group_by=model").json()
    assert body["totals"][0]["input_tokens"] == 7 and body["group_by"] == ["model"]
    text = client.get(f"/api/tenants/acme/reports/?start={start}&file=csv")
    rows = list(csv.reader(io.StringIO(b"".join(text.streaming_content).decode())))
    assert rows[-1][0] == "TOTAL" and "7" in rows[-1]
    xlsx = client.get(f"/api/tenants/acme/reports/?start={start}&file=xlsx")
    assert xlsx.content[:2] == b"PK"
    month = f"{now:%Y-%m}"
    statement = client.get(f"/api/tenants/acme/reports/statements/{month}/").json()
    assert statement["totals"][0]["output_tokens"] == 3
    assert client.get("/api/tenants/acme/reports/?group_by=colour").status_code == 400


def test_schema_and_docs_are_served(world):
    client = client_for(world, "owner")
    schema = client.get("/api/schema/?format=json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert "/api/tenants/{tenant}/keys/" in paths and "/api/pools/" in paths
    docs = client.get("/api/docs/")
    assert docs.status_code == 200 and b"swagger-ui" in docs.content
    assert b"cdn." not in docs.content  # served locally: the machines have no internet


def test_each_opt_in_documents_its_own_switch_body_and_answer(world):
    """The two opt-ins share one ``set`` action: the schema must still name each one's own
    serializer for its body and its answer, not the base class's or the other's."""
    paths = client_for(world, "owner").get("/api/schema/?format=json").json()["paths"]
    for path, name in (("content-logging", "ContentLogging"),
                       ("response-cache", "ResponseCache")):
        put = paths[f"/api/tenants/{{tenant}}/{path}/set/"]["put"]
        body = put["requestBody"]["content"]["application/json"]["schema"]
        answer = put["responses"]["200"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}Request"}, put
        assert answer == {"$ref": f"#/components/schemas/{name}"}, put


def test_content_logging_over_the_api_is_audited_even_for_a_token(world):
    from tenants.management_tokens import issue_token

    client = client_for(world, "owner")
    body = client.put("/api/tenants/acme/content-logging/set/", {"enabled": True},
                      format="json").json()
    assert body["enabled"] is True and body["changes"][0]["changed_by"] == "owner"
    _, plaintext = issue_token(world.tenant, "ci", "owner", created_by=world.users["owner"])
    token = APIClient()
    token.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    body = token.put("/api/tenants/acme/content-logging/set/", {"enabled": False},
                     format="json").json()
    assert body["enabled"] is False and len(body["changes"]) == 2


def test_an_export_over_the_api_runs_and_downloads(world, settings, tmp_path,
                                                   django_capture_on_commit_callbacks):
    from gateway.celery import app

    settings.MEDIA_ROOT = tmp_path
    now = this_hour()
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", now, prompt=11))
    client = client_for(world, "billing")
    app.conf.task_always_eager = True
    try:
        with django_capture_on_commit_callbacks(execute=True):
            job = client.post("/api/tenants/acme/exports/", {
                "start": (now - timedelta(hours=2)).isoformat(),
                "end": (now + timedelta(hours=1)).isoformat(), "group_by": "model"},
                format="json").json()
    finally:
        app.conf.task_always_eager = False
    assert client.get(f"/api/tenants/acme/exports/{job['id']}/").json()["status"] == "done"
    download = client.get(f"/api/tenants/acme/exports/{job['id']}/download/")
    text = b"".join(download.streaming_content).decode()
    assert text.splitlines()[-1].startswith("TOTAL,1,11,")
    assert client_for(world, "outsider").get(
        f"/api/tenants/acme/exports/{job['id']}/download/").status_code == 404


def test_time_filters_are_utc_and_impossible_times_are_a_400() -> None:
    """Schemathesis found a 500: an offset past PostgreSQL's 15:59 (ISO 8601 allows it)."""
    from rest_framework.exceptions import ValidationError

    from gateway.api.filters import parse_time

    when = parse_time("start", "1375-06-02T17:17:44.312456+20:49")
    assert when.utcoffset() is not None and when.utcoffset().total_seconds() == 0
    for text in ("2020-13-01", "0001-01-01T00:00:00+20:00", "yesterday"):
        with pytest.raises(ValidationError):
            parse_time("start", text)
