"""The budgets page: each budget's progress this period, the projected end-of-period spend,
and the keys a spend alert's hard cap stopped (owners resume them here or on the keys page)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.utils import timezone
from django.views.decorators.http import require_POST

from gateway.portal.tenancy import TenantRequest, tenant_view
from gateway.portal.views.base import page
from metering.billing.budget_status import status_of
from metering.billing.end_users import by_end_user
from tenants import roles
from tenants.models import ApiKey, Budget, Project, Tenant


class BudgetForm(forms.ModelForm[Budget]):
    class Meta:
        model = Budget
        fields = ["level", "project", "api_key", "end_user", "metric", "limit", "currency",
                  "period"]

    def __init__(self, *args: Any, tenant: Tenant, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.instance.tenant = tenant
        self.fields["project"].queryset = Project.objects.filter(tenant=tenant)  # type: ignore[attr-defined]
        self.fields["api_key"].queryset = ApiKey.objects.filter(  # type: ignore[attr-defined]
            tenant=tenant).usable()


@tenant_view("budgets")
def budgets_page(request: TenantRequest) -> HttpResponse:
    manage = roles.can(request.role, "manage_budgets")
    form = BudgetForm(request.POST or None, tenant=request.tenant)
    if request.method == "POST":
        if not manage:
            return HttpResponse("Only an owner changes budgets.", status=403)
        if form.is_valid():
            form.save()
            messages.success(request, "Budget added.")
            return redirect("portal:budgets")
    now = timezone.now()
    budgets = Budget.objects.filter(tenant=request.tenant).select_related("project", "api_key")
    rows = [status_of(b, now) for b in budgets]
    over = ApiKey.objects.filter(tenant=request.tenant, over_budget_at__isnull=False,
                                 revoked_at__isnull=True)
    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return page(request, "portal/budgets.html", {
        "rows": rows, "form": form, "manage": manage, "over_keys": over, "now": now,
        "month": month, "end_users": by_end_user(request.tenant, month, now)})


@tenant_view("budgets")
@require_POST
def budget_delete(request: TenantRequest, pk: int) -> HttpResponse:
    budget = get_object_or_404(Budget, pk=pk, tenant=request.tenant)
    if not roles.can(request.role, "manage_budgets"):
        return HttpResponse("Only an owner changes budgets.", status=403)
    budget.delete()
    messages.success(request, "Budget removed.")
    return redirect("portal:budgets")
