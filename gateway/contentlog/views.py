"""Minimal server-rendered staff pages for break-glass: request, list, read.

Approval happens in the admin (``BreakGlassGrantAdmin`` actions) by a second staff member.
Reading is a POST, so a decryption (and its audit entry) never happens on a prefetch or a
reload of a GET; the response is marked no-store.
"""

from __future__ import annotations

from datetime import timedelta

from django import forms
from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import permission_required
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods, require_POST

from gateway.contentlog import breakglass
from gateway.contentlog.display import as_messages
from gateway.contentlog.models import BreakGlassGrant
from tenants.models import Tenant


def staff_user(request: HttpRequest) -> User:
    """The signed-in user of a view behind ``staff_member_required`` (never anonymous)."""
    user = request.user
    if not isinstance(user, User):
        raise PermissionDenied("Sign in as staff.")
    return user


class DateTimePicker(forms.DateTimeInput):
    """The browser's own date-and-time picker (``datetime-local``, read as UTC here)."""

    input_type = "datetime-local"

    def __init__(self) -> None:
        super().__init__(format="%Y-%m-%dT%H:%M")


class RequestForm(forms.Form):
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.order_by("name"))
    justification = forms.CharField(widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
                                    min_length=breakglass.MIN_JUSTIFICATION)
    records_from = forms.DateTimeField(widget=DateTimePicker(), help_text="UTC")
    records_until = forms.DateTimeField(widget=DateTimePicker(), help_text="UTC")
    duration_minutes = forms.IntegerField(min_value=1, initial=60,
                                          label="Access for (minutes)")


@staff_member_required
@permission_required(breakglass.REQUEST_PERM, raise_exception=True)  # not even the tenant list
@require_http_methods(["GET", "POST"])
def index(request: HttpRequest) -> HttpResponse:
    form = RequestForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        d = form.cleaned_data
        try:
            breakglass.request_access(
                staff_user(request), d["tenant"], d["justification"], d["records_from"],
                d["records_until"], timedelta(minutes=d["duration_minutes"]),
            )
        except (breakglass.BreakGlassDenied, ValueError) as exc:
            form.add_error(None, str(exc))
        else:
            return redirect("breakglass:index")
    grants = BreakGlassGrant.objects.filter(
        requested_by=staff_user(request)).select_related("tenant")
    return render(request, "contentlog/index.html", {
        **admin.site.each_context(request), "title": "Break-glass access",
        "form": form, "grants": grants[:50]})


@staff_member_required
@permission_required(breakglass.REQUEST_PERM, raise_exception=True)
@never_cache
@require_POST
def read(request: HttpRequest, grant_id: int) -> HttpResponse:
    grant = get_object_or_404(BreakGlassGrant, pk=grant_id, requested_by=staff_user(request))
    context = {**admin.site.each_context(request), "title": f"Grant {grant.pk}", "grant": grant}
    try:
        records = breakglass.read_records(grant, staff_user(request))
    except breakglass.BreakGlassDenied as exc:
        return render(request, "contentlog/read.html", {**context, "error": str(exc)},
                      status=403)
    shown = [{"record": r, "prompt": as_messages(r.prompt), "response": as_messages(r.response)}
             for r in records]
    response = render(request, "contentlog/read.html", {**context, "records": shown})
    response["Cache-Control"] = "no-store"
    return response
