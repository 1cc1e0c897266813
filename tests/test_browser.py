"""The portal in real headless Chromium (Debian's ``chromium``, driven by Playwright).

One uvicorn gateway and one Celery pool worker with the simulated engine serve the module, so
the browser talks to the same ASGI app as production: portal pages, static files and the
streaming inference API on one origin. Kept to two tests: the machine has two shared cores.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tenants.models import Membership, Pool
from tests import procs
from tests.factories import make_key, make_model, make_tenant
from tests.worlds import PASSWORD, make_user, record, roll_up, this_hour

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
POOL, MODEL, WORKER = "browser-pool", "sim-browser", "browser-w1"
KEY_RE = re.compile(r"igw_[0-9A-Za-z]{43}_[0-9A-Za-z]{6}")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not shutil.which(CHROMIUM),
                       reason=f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run "
                              "does it)"),
]
playwright_api = pytest.importorskip("playwright.sync_api",
                                     reason="the playwright Python package is not installed")


def ensure_pool() -> None:
    # Transactional tests empty the tables after each test; the worker keeps running.
    model = make_model(MODEL)
    Pool.objects.get_or_create(name=POOL, defaults={
        "model": model, "backend_settings": {"decode_tokens_per_s": 200.0}})


@pytest.fixture(scope="module")
def system(live_system) -> dict[str, Any]:
    return live_system(pool=POOL, worker_ids=[WORKER], prepare=ensure_pool,
                       env={"WHITENOISE_USE_FINDERS": "1"})


@pytest.fixture(scope="module")
def browser(system: dict[str, Any]) -> Iterator[Any]:
    # Playwright's sync API runs an event loop in this thread; Django's ORM calls made by the
    # test itself between browser steps are still synchronous and safe. The servers start
    # first (``system``), so they never inherit this switch.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with playwright_api.sync_playwright() as pw:
            chromium = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
            yield chromium
            chromium.close()
    finally:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


@pytest.fixture
def owner(system, redis_client) -> dict[str, Any]:
    ensure_pool()
    procs.wait_for_worker(redis_client, POOL, WORKER, system["worker"], timeout=10)
    tenant = make_tenant("acme")
    user = make_user("owner")  # the gateway subprocess verifies the fast hash (fast_hasher.py)
    Membership.objects.create(user=user, tenant=tenant, role="owner")
    return {"tenant": tenant, "user": user, "url": system["url"]}


def snap(page: Any, name: str) -> None:
    """PORTAL_SCREENSHOTS=DIR keeps a screenshot of each step, for reviewing the pages."""
    if folder := os.environ.get("PORTAL_SCREENSHOTS"):
        page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=True)


def sign_in(browser: Any, url: str) -> Any:
    context = browser.new_context(accept_downloads=True)
    context.set_default_timeout(15_000)
    page = context.new_page()
    page.goto(url + "/portal/login/")
    page.fill("input[name=username]", "owner")
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/portal/usage/"))
    return page


def test_owner_creates_revokes_sees_usage_and_downloads_a_report(browser, owner):
    url, tenant = owner["url"], owner["tenant"]
    other_key, _ = make_key(tenant, name="busy key")
    now = this_hour()
    roll_up(*[record(tenant, other_key, MODEL, now - timedelta(hours=h), prompt=100 * (h + 1))
              for h in range(6)])
    page = sign_in(browser, url)

    page.click("text=API keys")
    page.click("text=Create a key")
    page.fill("input[name=name]", "browser key")
    page.click("button[type=submit]")
    plaintext = page.text_content("#new-key").strip()
    snap(page, "key-created")
    assert KEY_RE.fullmatch(plaintext)
    assert "only time it is shown" in page.text_content(".warning")
    page.click("#copy-key")
    page.wait_for_selector("#copied", state="visible")
    page.click("text=Back to keys")
    assert plaintext not in page.content()  # never shown again
    row = page.locator("tr", has_text="browser key")
    assert plaintext[:12] in row.text_content()

    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {plaintext}"})
    assert models.status_code == 200
    snap(page, "keys")
    row.locator("text=Revoke").click()
    page.click("#confirm-revoke")
    assert "revoked" in page.locator("tr", has_text="browser key").text_content()
    refused = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {plaintext}"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"

    page.click("text=Usage")
    page.select_option("select[name=by]", "key")
    page.click("form.filters button")
    series = page.locator("#chart-input polyline.series")
    assert series.count() == 1 and series.get_attribute("data-series").startswith("busy key")
    assert page.locator("#chart-input svg").is_visible()
    snap(page, "usage")

    page.click("text=Reports")
    page.check("input[name=group_by][value=model]")
    with page.expect_download() as info:
        page.click("#download-report")
    lines = Path(info.value.path()).read_text().splitlines()
    assert lines[0].startswith("tenant,key,model,requests")
    assert lines[-1].startswith("TOTAL,,,6,2100,")
    page.context.close()


def test_playground_streams_tokens(browser, owner):
    page = sign_in(browser, owner["url"])
    page.click("text=Playground")
    page.select_option("#pg-model", MODEL)
    page.click("#pg-mint")
    page.wait_for_selector("#pg-minted", state="visible")
    page.fill("#pg-max", "40")
    page.click("#pg-send")
    page.wait_for_function("document.getElementById('pg-meta').textContent.startsWith('Done')")
    meta = page.text_content("#pg-meta")
    snap(page, "playground")
    events = int(re.search(r"(\d+) events", meta).group(1))
    usage = re.search(r'"completion_tokens":(\d+)', meta)
    assert page.text_content("#pg-output").strip()
    assert re.search(r"finish: (stop|length)", meta)
    # Streamed: a role chunk, one chunk per token (or engine step), the usage chunk, [DONE].
    assert usage and events >= 3 + 1, meta
    page.context.close()
