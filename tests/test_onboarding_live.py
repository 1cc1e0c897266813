"""A new user, from the invitation email to a streamed completion, through the portal of a
live gateway, without an admin: the owner invites by email on the members page, the invitee
opens the emailed link, creates an account, creates a key in the portal and streams a chat
completion with the official ``openai`` client against the gateway and a real pool worker."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tenants.models import Membership
from tests import procs
from tests.factories import make_tenant
from tests.live_pool import MODEL, POOL, SERVER_ENV, ensure_pools
from tests.worlds import PASSWORD, make_user

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]
WORKER_ID = "onboarding-w1"
CSRF = re.compile(r'name="csrfmiddlewaretoken" value="([^"]+)"')


@pytest.fixture
def live(redis_client, tmp_path) -> Iterator[dict[str, object]]:
    """A gateway whose mail lands in files under ``tmp_path`` (Django's file backend)."""
    ensure_pools()
    env = {**SERVER_ENV, "EMAIL_BACKEND": "django.core.mail.backends.filebased.EmailBackend",
           "EMAIL_FILE_PATH": str(tmp_path)}
    worker = procs.start_worker(POOL, worker_id=WORKER_ID, env=env)
    gateway, url = procs.start_uvicorn(env=env)
    try:
        procs.wait_for_worker(redis_client, POOL, WORKER_ID, worker)
        procs.wait_for_http(url + "/healthz", gateway)
        yield {"url": url, "mail": tmp_path, "gateway": gateway}
    except BaseException:
        print(worker.logs()[-3000:], gateway.logs()[-3000:])
        raise
    finally:
        gateway.stop()
        worker.stop()


def _post_form(browser: httpx.Client, path: str, data: dict[str, str]) -> httpx.Response:
    """GET the page for its CSRF token, then POST the form as a browser would."""
    page = browser.get(path)
    assert page.status_code == 200, page.text[:500]
    token = CSRF.search(page.text).group(1)
    return browser.post(path, data={"csrfmiddlewaretoken": token, **data},
                        headers={"Referer": str(page.url)})


def _mail_to(folder: Path, address: str) -> str:
    messages = [p.read_text() for p in folder.iterdir()]
    [message] = [m for m in messages if f"To: {address}" in m]
    return message


def test_from_invitation_email_to_a_streamed_completion(live) -> None:
    url = str(live["url"])
    tenant = make_tenant("startup")
    owner = make_user("founder")  # the platform's real password hasher: the gateway checks it
    Membership.objects.create(user=owner, tenant=tenant, role="owner")

    with httpx.Client(base_url=url, follow_redirects=True, timeout=30) as founder:
        signed_in = _post_form(founder, "/portal/login/",
                               {"username": "founder", "password": PASSWORD})
        assert signed_in.status_code == 200 and "founder" in signed_in.text
        invited = _post_form(founder, "/portal/members/",
                             {"email": "newhire@startup.example", "role": "member"})
        assert "Invitation sent" in invited.text

    email = _mail_to(live["mail"], "newhire@startup.example")
    link = re.search(r"(http://\S+/portal/invitation/\S+/)", email).group(1)
    assert link.startswith(url)

    with httpx.Client(base_url=url, follow_redirects=True, timeout=30) as newcomer:
        joined = _post_form(newcomer, link.removeprefix(url), {
            "username": "newhire", "password1": PASSWORD, "password2": PASSWORD})
        assert joined.status_code == 200 and "Welcome to Startup" in joined.text
        created = _post_form(newcomer, "/portal/keys/new/", {"name": "my first key"})
        assert "only time it is shown" in created.text
        key = re.search(r'<code id="new-key">([^<]+)</code>', created.text).group(1)

    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
        stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text.strip()
    newhire = Membership.objects.get(user__username="newhire")
    assert newhire.tenant == tenant and newhire.role == "member"
