"""Break-glass: request, second-person approval, time box, audit before plaintext, owner mail."""

from __future__ import annotations

import base64
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core import mail
from django.db import connection, transaction
from django.utils import timezone

from gateway.contentlog import breakglass, crypto, store
from gateway.contentlog.models import AuditEntry, BreakGlassGrant
from tenants.models import Membership
from tests.factories import make_tenant

JUSTIFICATION = "Ticket 4411: customer reports abusive output, needs review."


@pytest.fixture(autouse=True)
def master(settings):
    settings.CONTENT_LOG_MASTER_KEYS = "k1:" + base64.b64encode(b"m" * 32).decode()
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    settings.ADMINS = [("ops", "ops@platform.example")]
    crypto.reset_keys()
    yield
    crypto.reset_keys()


def staff(name: str, *perms: str, is_staff: bool = True):
    user = get_user_model().objects.create_user(name, f"{name}@platform.example", "pw-123456",
                                                is_staff=is_staff)
    for perm in perms:
        user.user_permissions.add(Permission.objects.get(codename=perm))
    return get_user_model().objects.get(pk=user.pk)  # fresh permission cache


@pytest.fixture
def world(db):
    tenant = make_tenant("acme")
    owner = get_user_model().objects.create_user("alice", "alice@acme.example", "pw-123456")
    Membership.objects.create(user=owner, tenant=tenant, role=Membership.Role.OWNER)
    member = get_user_model().objects.create_user("bob", "bob@acme.example", "pw-123456")
    Membership.objects.create(user=member, tenant=tenant, role=Membership.Role.MEMBER)
    t0 = timezone.now()
    store.write_record(tenant.pk, "in-window", "PROMPT-1", "ANSWER-1", now=t0)
    store.write_record(tenant.pk, "too-old", "PROMPT-0", "ANSWER-0", now=t0 - timedelta(days=2))
    return {
        "tenant": tenant, "t0": t0,
        "requester": staff("reqr", "request_breakglass"),
        "approver": staff("appr", "approve_breakglass"),
    }


def ask(world, who=None, minutes=30):
    t0 = world["t0"]
    return breakglass.request_access(
        who or world["requester"], world["tenant"], JUSTIFICATION,
        t0 - timedelta(hours=1), t0 + timedelta(hours=1), timedelta(minutes=minutes),
    )


def test_the_full_flow_audits_every_decryption_and_mails_the_owners(world):
    grant = ask(world)
    with pytest.raises(breakglass.BreakGlassDenied):
        breakglass.read_records(grant, world["requester"])  # not approved yet
    breakglass.approve(grant, world["approver"])
    records = breakglass.read_records(grant, world["requester"])
    assert [(r.request_id, r.prompt, r.response) for r in records] == [
        ("in-window", "PROMPT-1", "ANSWER-1")]  # the out-of-window record stays sealed
    actions = list(AuditEntry.objects.filter(grant_id=grant.pk)
                   .order_by("id").values_list("action", "actor_username"))
    assert actions == [("requested", "reqr"), ("approved", "appr"), ("decrypted", "reqr")]
    entry = AuditEntry.objects.get(action="decrypted")
    assert entry.request_id == "in-window" and entry.justification == JUSTIFICATION
    assert entry.record_id is not None
    owners_mail = [m for m in mail.outbox if m.to == ["alice@acme.example"]]
    assert len(owners_mail) == 2  # approval, then the decryption
    assert "decrypted" in owners_mail[1].body and JUSTIFICATION in owners_mail[1].body
    assert all("bob@acme.example" not in m.to for m in mail.outbox)


def test_access_ends_when_the_time_box_does(world):
    grant = ask(world, minutes=30)
    breakglass.approve(grant, world["approver"])
    grant.refresh_from_db()
    later = grant.access_until + timedelta(seconds=1)
    assert breakglass.read_records(grant, world["requester"], now=later - timedelta(minutes=1))
    with pytest.raises(breakglass.BreakGlassDenied):
        breakglass.read_records(grant, world["requester"], now=later)


def test_self_approval_is_refused_by_default(world):
    both = staff("both", "request_breakglass", "approve_breakglass")
    grant = ask(world, who=both)
    with pytest.raises(breakglass.BreakGlassDenied):
        breakglass.approve(grant, both)
    grant.refresh_from_db()
    assert grant.state == "pending"


def test_self_approval_when_allowed_alerts_the_admins(world, settings):
    settings.BREAKGLASS_SELF_APPROVAL = True
    both = staff("both", "request_breakglass", "approve_breakglass")
    grant = breakglass.approve(ask(world, who=both), both)
    assert grant.self_approved
    assert AuditEntry.objects.filter(grant_id=grant.pk, action="self_approved").exists()
    assert any(m.to == ["ops@platform.example"] and "Self-approved" in m.subject
               for m in mail.outbox)


@pytest.mark.parametrize("perms,is_staff", [((), True), (("request_breakglass",), False)])
def test_only_staff_with_the_permission_may_request(world, perms, is_staff):
    with pytest.raises(breakglass.BreakGlassDenied):
        ask(world, who=staff("x", *perms, is_staff=is_staff))


def test_an_approver_without_the_permission_cannot_approve(world):
    grant = ask(world)
    with pytest.raises(breakglass.BreakGlassDenied):
        breakglass.approve(grant, staff("other", "request_breakglass"))


def test_only_the_requester_reads_under_a_grant(world):
    grant = breakglass.approve(ask(world), world["approver"])
    with pytest.raises(breakglass.BreakGlassDenied):
        breakglass.read_records(grant, staff("peer", "request_breakglass"))


def test_a_grant_is_decided_once(world):
    grant = breakglass.approve(ask(world), world["approver"])
    with pytest.raises(breakglass.BreakGlassDenied):
        breakglass.approve(grant, staff("second", "approve_breakglass"))


def test_a_revoked_or_denied_grant_reads_nothing(world):
    grant = breakglass.approve(ask(world), world["approver"])
    breakglass.revoke(grant, world["requester"])
    with pytest.raises(breakglass.BreakGlassDenied):
        breakglass.read_records(grant, world["requester"])
    denied = ask(world)
    breakglass.deny(denied, world["approver"])
    with pytest.raises(breakglass.BreakGlassDenied):
        breakglass.approve(denied, world["approver"])


@pytest.mark.parametrize("kwargs", [
    {"justification": "too short"},
    {"duration": timedelta(minutes=0)},
    {"duration": timedelta(days=2)},
])
def test_bad_requests_are_refused(world, kwargs):
    t0 = world["t0"]
    args = {"justification": JUSTIFICATION, "duration": timedelta(minutes=10)} | kwargs
    with pytest.raises(ValueError):
        breakglass.request_access(world["requester"], world["tenant"], args["justification"],
                                  t0 - timedelta(hours=1), t0, args["duration"])


def test_the_audit_log_is_append_only(world):
    ask(world)
    entry = AuditEntry.objects.first()
    entry.justification = "rewritten"
    with pytest.raises(PermissionError):
        entry.save()
    with pytest.raises(PermissionError):
        entry.delete()
    with pytest.raises(PermissionError):
        AuditEntry.objects.all().update(justification="x")
    with pytest.raises(PermissionError):
        AuditEntry.objects.all().delete()


def test_the_database_refuses_to_rewrite_the_audit_log(world):
    if connection.vendor != "postgresql":
        pytest.skip("the trigger is PostgreSQL-only")
    ask(world)
    with pytest.raises(Exception, match="append-only"), transaction.atomic(), \
            connection.cursor() as cur:
        cur.execute("DELETE FROM contentlog_auditentry")


def test_the_staff_pages_request_and_read_with_an_audit(world, client):
    client.force_login(world["requester"])
    t0 = world["t0"]
    response = client.post("/breakglass/", {
        "tenant": world["tenant"].pk, "justification": JUSTIFICATION,
        "records_from": (t0 - timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S"),
        "records_until": (t0 + timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S"),
        "duration_minutes": 15,
    })
    assert response.status_code == 302
    grant = BreakGlassGrant.objects.get()
    assert client.post(f"/breakglass/{grant.pk}/read/").status_code == 403  # not approved
    breakglass.approve(grant, world["approver"])
    response = client.post(f"/breakglass/{grant.pk}/read/")
    assert response.status_code == 200 and b"PROMPT-1" in response.content
    assert "no-store" in response["Cache-Control"]
    assert client.get(f"/breakglass/{grant.pk}/read/").status_code == 405
    assert AuditEntry.objects.filter(action="decrypted").count() == 1


def test_approval_through_the_admin_action_is_audited(world, client):
    grant = ask(world)
    approver = world["approver"]
    approver.user_permissions.add(Permission.objects.get(codename="view_breakglassgrant"))
    client.force_login(get_user_model().objects.get(pk=approver.pk))
    response = client.post("/admin/contentlog/breakglassgrant/", {
        "action": "approve_selected", "_selected_action": [grant.pk]})
    assert response.status_code == 302
    grant.refresh_from_db()
    assert grant.state == "approved" and grant.approved_by_id == approver.pk
