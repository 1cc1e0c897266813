"""Portal forms. Key caps are checked against the tenant's quotas by ``tenants.limits``."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django import forms
from django.conf import settings
from django.contrib.auth.forms import UserCreationForm
from django.contrib.auth.models import User
from django.core.validators import MaxValueValidator
from django.db import transaction
from django.utils import timezone

from catalog.models import ServedModel
from catalog.visibility import models_for
from gateway.portal.playground import PLAYGROUND_PREFIX
from metering.billing.models import SpendAlert
from metering.billing.reports import DEFAULT_GROUPS, GROUPS
from tenants.limits import key_cap_errors, quota_table
from tenants.models import (
    LIMIT_FIELDS,
    ApiKey,
    ContentLoggingChange,
    Membership,
    Project,
    Tenant,
)

GRACE_CHOICES = [
    (0, "Immediately"), (3600, "1 hour"), (86400, "24 hours"), (7 * 86400, "7 days"),
    (30 * 86400, "30 days"),
]


class KeyForm(forms.Form):
    name = forms.CharField(max_length=100)
    allowed_models = forms.ModelMultipleChoiceField(
        queryset=ServedModel.objects.none(), required=False,
        widget=forms.CheckboxSelectMultiple, help_text="None ticked = every model of the tenant.",
    )
    expires_at = forms.DateTimeField(
        required=False, widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
        help_text="Empty = never expires (UTC).",
    )
    project = forms.ModelChoiceField(
        queryset=Project.objects.none(), required=False,
        help_text="Its project's allowed models and budgets apply to the key too.",
    )
    input_tpm = forms.IntegerField(required=False, min_value=1, label="Input tokens / minute")
    output_tpm = forms.IntegerField(required=False, min_value=1, label="Output tokens / minute")
    concurrent_requests = forms.IntegerField(required=False, min_value=1)
    open_streams = forms.IntegerField(required=False, min_value=1)
    max_output_tokens = forms.IntegerField(required=False, min_value=1)

    def __init__(self, *args: Any, tenant: Tenant, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tenant = tenant
        allowed = self.fields["allowed_models"]
        assert isinstance(allowed, forms.ModelMultipleChoiceField)
        allowed.queryset = models_for(tenant)
        project = self.fields["project"]
        assert isinstance(project, forms.ModelChoiceField)
        project.queryset = Project.objects.filter(tenant=tenant)

    def clean_name(self) -> str:
        name: str = self.cleaned_data["name"]
        if name.lower().startswith(PLAYGROUND_PREFIX):  # that name marks the playground's key
            raise forms.ValidationError("Names starting with “playground ·” are reserved.")
        return name

    def clean_expires_at(self) -> datetime | None:
        value = self.cleaned_data.get("expires_at")
        if value is not None and value <= timezone.now():
            raise forms.ValidationError("The expiry must be in the future.")
        return value

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        for field, message in key_cap_errors(self.caps(), quota_table(self.tenant)).items():
            self.add_error(field, message)
        return data

    def caps(self) -> dict[str, int]:
        return {f: self.cleaned_data[f] for f in LIMIT_FIELDS if self.cleaned_data.get(f)}


class KeyEditForm(KeyForm):
    """Name, models and limits of an existing key. The expiry is not here: extending it would
    revive a retiring (rotated) key; a new expiry is a new key."""

    def __init__(self, *args: Any, key: ApiKey, **kwargs: Any) -> None:
        initial = {"name": key.name, "allowed_models": list(key.allowed_models.all()),
                   **{f: getattr(key, f) for f in LIMIT_FIELDS}}
        super().__init__(*args, tenant=key.tenant, initial=initial, **kwargs)
        del self.fields["expires_at"]
        self.key = key

    def clean_name(self) -> str:
        if self.cleaned_data["name"] == self.key.name:  # the playground key keeps its own name
            return self.key.name
        return super().clean_name()

    def save(self) -> ApiKey:
        """One UPDATE of the row and one of its model set; either change drops every gateway's
        cached copy of the key (``tenants.signals``), so the next request sees the new limits."""
        data = self.cleaned_data
        self.key.name = data["name"]
        for field in LIMIT_FIELDS:
            setattr(self.key, field, data.get(field) or None)
        with transaction.atomic():
            self.key.save(update_fields=["name", *LIMIT_FIELDS])
            self.key.allowed_models.set(data["allowed_models"])
        return self.key


class RotateForm(forms.Form):
    grace_seconds = forms.TypedChoiceField(
        choices=GRACE_CHOICES, coerce=int, initial=86400,
        label="The old key keeps working for",
    )

    def grace(self) -> timedelta:
        return timedelta(seconds=self.cleaned_data["grace_seconds"])


class ContentLoggingForm(forms.Form):
    """One content-storing opt-in switched (``setting``: content logging or the response cache)."""

    setting = forms.ChoiceField(choices=ContentLoggingChange.Setting.choices,
                                initial=ContentLoggingChange.Setting.CONTENT_LOGGING,
                                widget=forms.HiddenInput, required=False)
    enabled = forms.BooleanField(required=False)
    confirm = forms.BooleanField(
        required=True, label="I have read what is stored and for how long."
    )


class ReportForm(forms.Form):
    start = forms.DateTimeField(widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))
    end = forms.DateTimeField(widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))
    group_by = forms.MultipleChoiceField(
        choices=[(g, g.replace("_", " ")) for g in GROUPS], initial=list(DEFAULT_GROUPS),
        required=False,
        widget=forms.CheckboxSelectMultiple,
    )
    format = forms.ChoiceField(choices=[("csv", "CSV"), ("xlsx", "Excel (XLSX)")])

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        if data.get("start") and data.get("end") and data["end"] <= data["start"]:
            raise forms.ValidationError("The end must come after the start.")
        if data.get("start") and data["start"] > timezone.now():  # no usage there yet
            raise forms.ValidationError("The range starts in the future: there is no usage "
                                        "to report yet.")
        return data


class AlertForm(forms.ModelForm[SpendAlert]):
    webhook_url = forms.URLField(required=False, assume_scheme="https",
                                 help_text="Optional: POSTed a JSON body on firing.")

    class Meta:
        model = SpendAlert
        fields = ["api_key", "metric", "period", "threshold", "currency", "webhook_url",
                  "hard_cap"]

    def __init__(self, *args: Any, tenant: Tenant, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        api_key = self.fields["api_key"]
        assert isinstance(api_key, forms.ModelChoiceField)
        api_key.queryset = ApiKey.objects.filter(tenant=tenant).usable()
        api_key.required = False
        api_key.empty_label = "Whole tenant"
        self.fields["currency"].required = False
        self.fields["currency"].help_text = "Money alerts: the threshold's currency (ISO code)."

    def clean_currency(self) -> str:
        value = (self.cleaned_data.get("currency") or "").strip().upper()
        if value and (len(value) != 3 or not value.isalpha()):
            raise forms.ValidationError("A three-letter ISO 4217 code, such as USD or EUR.")
        return value or SpendAlert._meta.get_field("currency").default


class TokenForm(forms.Form):
    name = forms.CharField(max_length=100)
    role = forms.ChoiceField(choices=Membership.Role.choices, initial=Membership.Role.BILLING)
    expires_in_days = forms.IntegerField(
        min_value=1, label="Expires in (days)",
        help_text="Every token expires. It also stops when you stop being an owner here.",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields["expires_in_days"]
        assert isinstance(field, forms.IntegerField)
        field.initial = settings.MANAGEMENT_TOKEN_DEFAULT_DAYS
        field.max_value = settings.MANAGEMENT_TOKEN_MAX_DAYS
        field.validators.append(MaxValueValidator(settings.MANAGEMENT_TOKEN_MAX_DAYS))
        field.widget.attrs["max"] = settings.MANAGEMENT_TOKEN_MAX_DAYS


class InviteForm(forms.Form):
    email = forms.EmailField(label="Email address")
    role = forms.ChoiceField(choices=Membership.Role.choices, initial=Membership.Role.MEMBER)


class AcceptInvitationForm(UserCreationForm[User]):
    """A new account for an invitee; the email is the invited address.

    The form never says a username is taken (review 3: the link's form enumerated accounts):
    a taken name is made unique when the account is created (``invitations.free_username``)
    and the welcome message names the account's username.
    """

    class Meta(UserCreationForm.Meta):
        fields = ("username",)

    def clean_username(self) -> str:
        return str(self.cleaned_data["username"])  # no "already exists": see the docstring

    def validate_unique(self) -> None:
        """Uniqueness is the account creation's (``accept_with_new_account``), not the form's."""
