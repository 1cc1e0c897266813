"""Usage by end user (the request's ``safety_identifier``/``user`` or the tenant's header):
requests, tokens and exact spend per end user over a range, from the usage records (rollups
do not keep end users). Costs are exact decimals per currency, rounded only when shown."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from django.db.models import Count, Sum
from django.db.models.functions import TruncHour

from metering.billing.pricing import PriceBook
from metering.models import UsageRecord
from tenants.models import Tenant


@dataclass
class EndUserUsage:
    end_user: str
    requests: int = 0
    tokens: int = 0
    spend: dict[str, Decimal] = field(default_factory=dict)  # currency -> exact cost


def by_end_user(tenant: Tenant, start: datetime, end: datetime,
                limit: int = 50) -> list[EndUserUsage]:
    """The ``limit`` end users with the most tokens in [start, end), most first."""
    groups = (UsageRecord.objects.filter(tenant=tenant, finished_at__gte=start,
                                         finished_at__lt=end).exclude(end_user="")
              .annotate(hour=TruncHour("finished_at"))
              .values("end_user", "model_name", "hour")
              .annotate(n=Count("id"), p=Sum("prompt_tokens"), c=Sum("cached_tokens"),
                        o=Sum("completion_tokens")).order_by())
    rows = list(groups)
    book = PriceBook({r["model_name"] for r in rows})
    out: dict[str, EndUserUsage] = defaultdict(lambda: EndUserUsage(""))
    for r in rows:
        usage = out[r["end_user"]]
        usage.end_user = r["end_user"]
        usage.requests += r["n"]
        usage.tokens += r["p"] + r["o"]
        cost, currency = book.cost(r["model_name"], r["hour"], r["p"], r["c"], r["o"])
        if currency:
            usage.spend[currency] = usage.spend.get(currency, Decimal(0)) + cost
    return sorted(out.values(), key=lambda u: (-u.tokens, u.end_user))[:limit]
