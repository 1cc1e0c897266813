"""The password-reset form, rate-limited per address and per client (``infra.email_limits``).

Over a limit the form answers exactly as when the email is sent (the "sent" page), so the
limit reveals nothing about which addresses have accounts; the email is just not sent.
"""

from __future__ import annotations

import logging

from django.contrib.auth.forms import PasswordResetForm
from django.contrib.auth.views import PasswordResetView
from django.http import HttpResponse, HttpResponseRedirect

from infra.email_limits import allow_email

log = logging.getLogger(__name__)


class LimitedPasswordResetView(PasswordResetView):
    def form_valid(self, form: PasswordResetForm) -> HttpResponse:
        client = self.request.META.get("REMOTE_ADDR") or "unknown"  # the decided client
        if not allow_email("reset", form.cleaned_data["email"], f"ip:{client}"):
            log.warning("password-reset email not sent: over the hourly limit")
            return HttpResponseRedirect(self.get_success_url())
        return super().form_valid(form)
