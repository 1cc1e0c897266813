"""What ``manage.py serve`` reports about a pool's worker, as the Pool admin shows it."""

from __future__ import annotations

import pytest

from catalog import serve_status
from catalog.models import Pool
from tests.factories import make_model

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client(client, django_user_model):
    client.force_login(django_user_model.objects.create_superuser("st", "st@example.com", "x"))
    return client


def test_a_failing_worker_shows_its_exit_and_output_with_a_warning(admin_client, redis_client):
    pool = Pool.objects.create(name="st-bad", model=make_model("st-m"))
    serve_status.report("st-bad", state="failing", pid=4242, last_exit="exit status 1",
                        output="EngineConfigError: unknown setting <warp_drive>", restarts=3)
    page = admin_client.get(f"/admin/catalog/pool/{pool.pk}/change/").content.decode()
    assert "<strong>failing</strong> (pid 4242, 3 restarts" in page
    assert "Last exit: exit status 1" in page
    assert "unknown setting &lt;warp_drive&gt;" in page  # the worker's words, escaped
    assert "This pool&#x27;s worker keeps exiting (exit status 1)" in page
    listing = admin_client.get("/admin/catalog/pool/").content.decode()
    assert '<td class="field-worker_state">failing</td>' in listing


def test_a_running_worker_and_a_pool_serve_does_not_run(admin_client, redis_client):
    ok = Pool.objects.create(name="st-ok", model=make_model("st-m"))
    other = Pool.objects.create(name="st-none", model=make_model("st-m"))
    serve_status.report("st-ok", state="running", pid=7, restarts=0)
    page = admin_client.get(f"/admin/catalog/pool/{ok.pk}/change/").content.decode()
    assert "<strong>running</strong> (pid 7, 0 restarts" in page and "keeps exiting" not in page
    page = admin_client.get(f"/admin/catalog/pool/{other.pk}/change/").content.decode()
    assert "not run by manage.py serve" in page
    serve_status.clear("st-ok")
    assert serve_status.read("st-ok") is None
