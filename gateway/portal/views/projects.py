"""Projects (a tenant's groups of keys, each with its own allowed models) and the tenant's
end-user header: owners create and edit them here; billing members read them. Saving either
invalidates the cached principals (``tenants.signals``), so the next request obeys it."""

from __future__ import annotations

import re
from typing import Any

from django import forms
from django.contrib import messages
from django.db.models import Count
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.utils.text import slugify

from catalog.visibility import models_for
from gateway.portal.tenancy import TenantRequest, tenant_view
from gateway.portal.views.base import page
from tenants import roles
from tenants.models import Project, Tenant

ONLY_OWNERS = "Only an owner changes projects and the end-user header."
HEADER_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
# Headers that carry secrets or routing: an end user's name is stored in usage records, so
# it must never come from one of these.
FORBIDDEN_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "x-api-key",
                               "host", "content-type", "content-length"})


class ProjectForm(forms.ModelForm[Project]):
    class Meta:
        model = Project
        fields = ["name", "allowed_models"]
        widgets = {"allowed_models": forms.CheckboxSelectMultiple}

    def __init__(self, *args: Any, tenant: Tenant, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.instance.tenant = tenant
        field = self.fields["allowed_models"]
        assert isinstance(field, forms.ModelMultipleChoiceField)
        field.queryset = models_for(tenant)  # only models this tenant may use

    def clean_name(self) -> str:
        name = str(self.cleaned_data["name"]).strip()
        slug = slugify(name)[:64]
        if not slug:
            raise forms.ValidationError("A name needs at least one letter or digit.")
        taken = Project.objects.filter(tenant=self.instance.tenant, slug=slug)
        if self.instance.pk:
            taken = taken.exclude(pk=self.instance.pk)
        if taken.exists():
            raise forms.ValidationError("This tenant already has a project so named.")
        self.instance.slug = slug
        return name


class EndUserHeaderForm(forms.ModelForm[Tenant]):
    class Meta:
        model = Tenant
        fields = ["end_user_header"]

    def clean_end_user_header(self) -> str:
        value = str(self.cleaned_data["end_user_header"]).strip().lower()
        if value and not HEADER_NAME.match(value):
            raise forms.ValidationError("A header name is letters, digits and dashes "
                                        "(e.g. x-end-user).")
        if value in FORBIDDEN_HEADERS:
            raise forms.ValidationError(f"{value} cannot name end users: it carries secrets "
                                        "or routing.")
        return value


@tenant_view("budgets")
def projects_page(request: TenantRequest) -> HttpResponse:
    manage = roles.can(request.role, "manage_budgets")
    tenant = request.tenant
    form = ProjectForm(tenant=tenant)
    header_form = EndUserHeaderForm(instance=tenant)
    if request.method == "POST":
        if not manage:
            return HttpResponse(ONLY_OWNERS, status=403)
        if "end_user_header" in request.POST:
            header_form = EndUserHeaderForm(request.POST, instance=tenant)
            if header_form.is_valid():
                header_form.save()
                messages.success(request, "End-user header saved.")
                return redirect("portal:projects")
        else:
            form = ProjectForm(request.POST, tenant=tenant)
            if form.is_valid():
                form.save()
                messages.success(request, "Project created.")
                return redirect("portal:projects")
    projects = (Project.objects.filter(tenant=tenant).prefetch_related("allowed_models")
                .annotate(n_keys=Count("api_keys")))
    return page(request, "portal/projects.html", {
        "projects": projects, "form": form, "header_form": header_form, "manage": manage})


@tenant_view("manage_budgets")
def project_edit(request: TenantRequest, pk: int) -> HttpResponse:
    project = get_object_or_404(Project, pk=pk, tenant=request.tenant)
    form = ProjectForm(request.POST or None, instance=project, tenant=request.tenant)
    if request.method == "POST" and form.is_valid():
        form.save()
        messages.success(request, f"Project {project.name} saved.")
        return redirect("portal:projects")
    return page(request, "portal/project_edit.html", {"project": project, "form": form})

