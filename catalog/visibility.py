"""Which served models a tenant may use: the single answer for the portal, the management API
and the key forms (the inference path applies the same rule to its cached pool table,
``gateway.inference.pools``)."""

from __future__ import annotations

from collections.abc import Iterable

from django.db.models import Model, Q, QuerySet

from catalog.models import ServedModel


def models_for(tenant: Model | Iterable[int]) -> QuerySet[ServedModel]:
    """Models with an enabled pool the tenant(s) may be routed to: shared, or dedicated to it.

    A model served only by another tenant's dedicated pool is not here: to this tenant it does
    not exist. ``tenant`` is a ``tenants.Tenant`` or tenant ids (the catalog imports no tenants
    code: a pool names its tenant by id).
    """
    ids = [tenant.pk] if isinstance(tenant, Model) else list(tenant)
    return ServedModel.objects.filter(
        Q(pools__dedicated_to__isnull=True) | Q(pools__dedicated_to_id__in=ids),
        pools__enabled=True,
    ).distinct().order_by("name")
