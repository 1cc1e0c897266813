"""Hourly rollups gain the end user as part of their key (reports grouped by end user).

Rows written before have ``end_user = ''`` for every request; the hours that hold records with
an end user are recomputed from those records here, so such a report is right from the start
and no hour is counted twice (each recomputed hour's rows are replaced, as in
``metering.rollups.rollup_hour``).
"""

from datetime import timedelta
from typing import Any

from django.db import migrations, models
from django.db.models import Count, Q, Sum
from django.db.models.functions import Coalesce, TruncHour


def regroup_hours_with_end_users(apps: Any, schema_editor: Any) -> None:
    record_model = apps.get_model("metering", "UsageRecord")
    rollup_model = apps.get_model("metering", "UsageRollup")
    hours = (record_model.objects.exclude(end_user="")
             .annotate(h=TruncHour("finished_at")).values_list("h", flat=True).distinct())
    for hour in hours:
        groups = (
            record_model.objects.filter(finished_at__gte=hour,
                                        finished_at__lt=hour + timedelta(hours=1))
            .values("tenant_id", "api_key_id", "model_name", "end_user")
            .annotate(n=Count("id"), n_err=Count("id", filter=~Q(status="ok")),
                      prompt=Sum("prompt_tokens"), cached=Sum("cached_tokens"),
                      completion=Sum("completion_tokens"), ttft=Coalesce(Sum("ttft_ms"), 0),
                      total=Coalesce(Sum("total_ms"), 0))
            .order_by()
        )
        rollup_model.objects.filter(hour=hour).delete()
        rollup_model.objects.bulk_create([
            rollup_model(hour=hour, tenant_id=g["tenant_id"], api_key_id=g["api_key_id"],
                         model_name=g["model_name"], end_user=g["end_user"], requests=g["n"],
                         errors=g["n_err"], prompt_tokens=g["prompt"], cached_tokens=g["cached"],
                         completion_tokens=g["completion"], ttft_ms_sum=g["ttft"],
                         total_ms_sum=g["total"])
            for g in groups])


class Migration(migrations.Migration):

    dependencies = [
        ("metering", "0003_request_log"),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="usagerollup",
            name="one_rollup_per_hour_group",
        ),
        migrations.AddField(
            model_name="usagerollup",
            name="end_user",
            field=models.CharField(blank=True, default="", max_length=256),
        ),
        migrations.AddConstraint(
            model_name="usagerollup",
            constraint=models.UniqueConstraint(
                fields=("hour", "tenant", "api_key", "model_name", "end_user"),
                name="one_rollup_per_hour_group_user"),
        ),
        migrations.RunPython(regroup_hours_with_end_users, migrations.RunPython.noop),
    ]
