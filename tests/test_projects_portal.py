"""The portal's projects page: owners create and edit projects (name, allowed models) and set
the tenant's end-user header; billing reads; members, outsiders and staff without permissions
neither read nor change anything."""

from __future__ import annotations

import pytest
from django.urls import reverse

from catalog.visibility import models_for
from tenants.models import Project, Tenant
from tests.worlds import build_world

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(redis_client):
    return build_world()


def signed_in(client, world, who):
    client.force_login(world.users[who])
    return client


def test_owner_creates_and_edits_a_project_with_allowed_models(client, world):
    model = models_for(world.tenant).first()
    owner = signed_in(client, world, "owner")
    page = owner.get(reverse("portal:projects")).content.decode()
    assert 'id="project-form"' in page and 'name="viewport"' in page
    answer = owner.post(reverse("portal:projects"), {"name": "Production web",
                                                     "allowed_models": [model.pk]})
    assert answer.status_code == 302
    project = Project.objects.get(tenant=world.tenant)
    assert (project.slug, [m.pk for m in project.allowed_models.all()]) == (
        "production-web", [model.pk])
    again = owner.post(reverse("portal:projects"), {"name": "production web"})
    assert "already has a project so named" in again.content.decode()
    edit = reverse("portal:project_edit", args=[project.pk])
    assert owner.post(edit, {"name": "Staging"}).status_code == 302
    project.refresh_from_db()
    assert (project.name, project.slug, project.allowed_models.count()) == (
        "Staging", "staging", 0)
    listing = owner.get(reverse("portal:projects")).content.decode()
    assert "Staging" in listing and "every model the tenant may use" in listing


def test_a_project_allows_only_models_the_tenant_may_use(client, world):
    from catalog.models import ServedModel

    usable = set(models_for(world.tenant).values_list("pk", flat=True))
    foreign = ServedModel.objects.exclude(pk__in=usable).values_list("pk", flat=True).first()
    for pk in [p for p in (foreign, 10**9) if p is not None]:
        answer = signed_in(client, world, "owner").post(
            reverse("portal:projects"), {"name": "x", "allowed_models": [pk]})
        assert answer.status_code == 200 and "errorlist" in answer.content.decode()
    assert not Project.objects.exists()


def test_owner_sets_the_end_user_header_and_bad_names_are_refused(client, world):
    owner = signed_in(client, world, "owner")
    url = reverse("portal:projects")
    assert owner.post(url, {"end_user_header": "X-End-User"}).status_code == 302
    assert Tenant.objects.get(pk=world.tenant.pk).end_user_header == "x-end-user"
    for bad in ("authorization", "x end user", "cookie"):
        page = owner.post(url, {"end_user_header": bad}).content.decode()
        assert "errorlist" in page, bad
    assert Tenant.objects.get(pk=world.tenant.pk).end_user_header == "x-end-user"
    assert 'id="end-user-header">x-end-user' in owner.get(url).content.decode()
    assert owner.post(url, {"end_user_header": ""}).status_code == 302
    assert Tenant.objects.get(pk=world.tenant.pk).end_user_header == ""


@pytest.mark.parametrize("who", ["member", "billing", "outsider", "staff"])
def test_only_owners_change_projects_or_the_header(client, world, who):
    project = Project.objects.create(tenant=world.tenant, name="web", slug="web")
    c = signed_in(client, world, who)
    listing = c.get(reverse("portal:projects"))
    if who == "billing":  # reads, without the forms
        body = listing.content.decode()
        assert listing.status_code == 200 and "web" in body and "project-form" not in body
    elif who == "outsider":  # an owner of another tenant sees that tenant's projects only
        assert "web" not in listing.content.decode()
    else:
        assert listing.status_code in (302, 403)
    c.post(reverse("portal:projects"), {"name": "sneaky"})
    c.post(reverse("portal:projects"), {"end_user_header": "x-sneaky"})
    edit = c.post(reverse("portal:project_edit", args=[project.pk]), {"name": "renamed"})
    assert edit.status_code in (302, 403, 404)
    assert list(Project.objects.filter(tenant=world.tenant).values_list("name", flat=True)) \
        == ["web"]
    assert Tenant.objects.get(pk=world.tenant.pk).end_user_header == ""
