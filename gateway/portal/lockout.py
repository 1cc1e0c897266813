"""Sign-in lockout that explains itself, and a password reset that lifts it.

django-axes locks a username + address pair after ``AXES_FAILURE_LIMIT`` failures for
``AXES_COOLOFF_TIME``, counted from the last failure. Its default page says neither how long to
wait nor what else to do; this one says both (and sends ``Retry-After``). A password reset
proves the person holds the account's mailbox, so it clears that account's failures: otherwise
the new password would be refused until the cool-off ends.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

from axes.helpers import get_client_username, get_cool_off
from axes.models import AccessAttempt
from axes.utils import reset
from django.contrib.auth.forms import SetPasswordForm
from django.contrib.auth.views import PasswordResetConfirmView
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

TEMPLATE = "portal/locked_out.html"


def locked_until(username: str, cool_off: timedelta) -> datetime:
    """When the lock on ``username`` ends: the cool-off after its latest failure (from any
    address: the page must not tell one address about another's attempts, and the latest
    failure bounds them all)."""
    latest = (AccessAttempt.objects.filter(username=username)
              .order_by("-attempt_time").values_list("attempt_time", flat=True).first())
    return (latest or timezone.now()) + cool_off


def lockout_response(request: HttpRequest, original_response: HttpResponse | None = None,
                     credentials: dict[str, Any] | None = None) -> HttpResponse:
    """``AXES_LOCKOUT_CALLABLE``: a 429 page saying how long to wait, with ``Retry-After``."""
    cool_off = get_cool_off(request) or timedelta(minutes=15)
    username = get_client_username(request, credentials) or ""
    until = locked_until(username, cool_off)
    seconds = max(int((until - timezone.now()).total_seconds()), 1)
    minutes = math.ceil(seconds / 60)
    response = render(request, TEMPLATE, {
        "minutes": minutes, "until": until, "username": username}, status=429)
    response["Retry-After"] = str(seconds)
    return response


class UnlockingPasswordResetConfirmView(PasswordResetConfirmView):
    """Django's set-a-new-password step, which also clears the account's sign-in lockout."""

    def form_valid(self, form: SetPasswordForm) -> HttpResponse:  # type: ignore[type-arg]
        response = super().form_valid(form)
        reset(username=form.user.get_username())
        return response
