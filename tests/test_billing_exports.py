"""Export jobs: claimed once, progress recorded, failures kept for the page."""

from __future__ import annotations

import csv
from datetime import timedelta
from pathlib import Path

import pytest

from metering.billing import exports
from metering.billing.models import ExportJob
from tests.worlds import build_world, record, roll_up, this_hour

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(redis_client, settings, tmp_path):
    settings.MEDIA_ROOT = tmp_path
    return build_world()


def _job(world, **fields):
    now = this_hour()
    return ExportJob.objects.create(tenant=world.tenant, start=now - timedelta(days=1),
                                    end=now + timedelta(hours=1), **fields)


def test_a_job_runs_once_and_records_progress(world, monkeypatch):
    monkeypatch.setattr("metering.billing.reports.PROGRESS_EVERY", 2)
    now = this_hour()
    roll_up(*[record(world.tenant, world.keys["owner"], "sim-small", now - timedelta(hours=h))
              for h in range(5)])
    seen = []
    real = exports._progress
    monkeypatch.setattr(exports, "_progress",
                        lambda job_id, done, total: (seen.append((done, total)),
                                                     real(job_id, done, total)))
    job = _job(world, group_by="model")
    assert exports.run(job.pk) is True
    assert exports.run(job.pk) is False  # a duplicate task message changes nothing
    job.refresh_from_db()
    assert (job.status, job.rows_done, job.rows_total, job.progress) == ("done", 5, 5, 100)
    assert seen == [(2, 5), (4, 5), (5, 5)]
    rows = list(csv.reader(Path(job.file_path).read_text().splitlines()))
    assert rows[-1][:2] == ["TOTAL", "5"]


def test_a_failure_is_recorded(world, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("metering.billing.reports.build_report", boom)
    job = _job(world)
    with pytest.raises(RuntimeError):
        exports.run(job.pk)
    job.refresh_from_db()
    assert job.status == "failed" and "disk full" in job.error


def test_size_decides_streaming_or_background(world, settings):
    settings.EXPORT_INLINE_MAX_ROWS = 2
    now = this_hour()
    start, end = now - timedelta(days=1), now + timedelta(hours=1)
    roll_up(*[record(world.tenant, world.keys["owner"], "sim-small", now - timedelta(hours=h))
              for h in range(2)])
    assert not exports.is_large(start, end, world.tenant)
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", now - timedelta(hours=3)))
    assert exports.is_large(start, end, world.tenant)
    assert not exports.is_large(start, end, world.other)


def test_week_old_exports_and_their_files_are_purged(world):
    job = _job(world)
    exports.run(job.pk)
    job.refresh_from_db()
    assert exports.purge_old(now=job.created_at + timedelta(days=6)) == 0
    assert exports.purge_old(now=job.created_at + timedelta(days=8)) == 1
    assert not Path(job.file_path).exists() and not ExportJob.objects.exists()
