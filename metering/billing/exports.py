"""Report exports: small ones stream in the response, large ones run as a Celery task.

"Large" is counted in rollup rows (one indexed COUNT), the work a report does. The task claims
its job with a conditional UPDATE (pending -> running), so a redelivered or duplicated task
message never builds the same file twice, and records progress as it goes for the page to show.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from celery import shared_task
from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from metering.billing import reports
from metering.billing.models import ExportJob
from tenants.models import Tenant


def export_dir() -> Path:
    path = Path(settings.MEDIA_ROOT) / "exports"
    path.mkdir(parents=True, exist_ok=True)
    return path


def is_large(
    start: datetime, end: datetime, tenant: Tenant | None, api_key_ids: list[int] | None = None
) -> bool:
    qs = reports.rollups(start, end, tenant=tenant, api_key_ids=api_key_ids)
    return qs[: settings.EXPORT_INLINE_MAX_ROWS + 1].count() > settings.EXPORT_INLINE_MAX_ROWS


def queue_export(
    *, tenant: Tenant | None, user: User | None, start: datetime, end: datetime, group_by: str,
    fmt: str,
) -> ExportJob:
    """Create the job and enqueue its task once the row is committed (the task reads it)."""
    job = ExportJob.objects.create(
        tenant=tenant, requested_by=user, start=reports.floor_hour(start),
        end=reports.ceil_hour(end), group_by=group_by, format=fmt,
    )
    transaction.on_commit(lambda: run_export.delay(job.pk))
    return job


def run(job_id: int) -> bool:
    """Build the file for one job; False if the job is gone or someone else claimed it."""
    claimed = ExportJob.objects.filter(pk=job_id, status=ExportJob.Status.PENDING).update(
        status=ExportJob.Status.RUNNING
    )
    if not claimed:
        return False
    job = ExportJob.objects.select_related("tenant").get(pk=job_id)
    try:
        report = reports.build_report(
            job.start, job.end, tenant=job.tenant, group_by=reports.parse_group_by(job.group_by),
            progress=lambda done, total: _progress(job_id, done, total),
        )
        path = export_dir() / f"{job.pk}-{job.filename}"
        if job.format == ExportJob.Format.XLSX:
            with open(path, "wb") as out:
                reports.write_xlsx(report, out)
        else:
            with open(path, "w", newline="", encoding="utf-8") as text:
                reports.write_csv(report, text)
    except Exception as exc:  # recorded for the page; the task itself never retries
        ExportJob.objects.filter(pk=job_id).update(
            status=ExportJob.Status.FAILED, error=str(exc)[:2000], finished_at=timezone.now()
        )
        raise
    ExportJob.objects.filter(pk=job_id).update(
        status=ExportJob.Status.DONE, file_path=str(path), finished_at=timezone.now()
    )
    return True


@shared_task(name="billing.run_export", ignore_result=True)
def run_export(job_id: int) -> bool:
    """The Celery task of ``run``; defined here, beside ``queue_export`` that enqueues it."""
    return run(job_id)


def _progress(job_id: int, done: int, total: int) -> None:
    ExportJob.objects.filter(pk=job_id).update(rows_done=done, rows_total=max(total, done))


def purge_old(keep: timedelta = timedelta(days=7), now: datetime | None = None) -> int:
    """Delete export jobs older than ``keep`` and their files; returns how many."""
    old = ExportJob.objects.filter(created_at__lt=(now or timezone.now()) - keep).exclude(
        status=ExportJob.Status.RUNNING
    )
    count = 0
    for job in old:
        if job.file_path:
            Path(job.file_path).unlink(missing_ok=True)
        count += ExportJob.objects.filter(pk=job.pk).delete()[0]
    return count
