"""Review 3, N4: every admin action has its permission. The role matrix of the API
(``tests/test_api_permissions.py``) extended to the admin's actions: each registered action
names the permissions it needs, and staff with only the view permission cannot run one."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from tenants.models import Tenant
from tests.factories import make_tenant
from tests.worlds import make_user

pytestmark = pytest.mark.django_db


def _actions() -> list[tuple[str, str, object]]:
    out = []
    for model, model_admin in admin.site._registry.items():
        for action in model_admin.actions or ():
            fn = getattr(model_admin, action) if isinstance(action, str) else action
            out.append((model._meta.label, getattr(fn, "__name__", str(action)), fn))
    return out


def test_every_registered_admin_action_names_its_permission() -> None:
    actions = _actions()
    assert {name for _, name, _ in actions} >= {"suspend_selected", "activate_selected",
                                                "revoke_selected", "approve_selected"}
    missing = [f"{label}.{name}" for label, name, fn in actions
               if not getattr(fn, "allowed_permissions", ())]
    assert missing == []


def _staff_with(*codenames: str) -> Client:
    user = make_user("viewer", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.parametrize(("action", "start", "perms", "after"), [
    ("suspend_selected", Tenant.Status.ACTIVE, ["view_tenant"], Tenant.Status.ACTIVE),
    ("activate_selected", Tenant.Status.SUSPENDED, ["view_tenant"], Tenant.Status.SUSPENDED),
    ("suspend_selected", Tenant.Status.ACTIVE, ["view_tenant", "change_tenant"],
     Tenant.Status.SUSPENDED),
    ("activate_selected", Tenant.Status.SUSPENDED, ["view_tenant", "change_tenant"],
     Tenant.Status.ACTIVE),
])
def test_tenant_bulk_actions_need_the_change_permission(action: str, start: str,
                                                        perms: list[str], after: str) -> None:
    tenant = make_tenant("beta")
    tenant.set_status(start)
    client = _staff_with(*perms)
    url = reverse("admin:tenants_tenant_changelist")
    assert client.get(url).status_code == 200  # the viewer may look
    client.post(url, {"action": action, "_selected_action": [tenant.pk]})
    tenant.refresh_from_db()
    assert tenant.status == after
