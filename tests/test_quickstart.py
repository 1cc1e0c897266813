"""The quick start's promise: what ``bootstrap_demo`` prints streams a completion, as printed.

The README's first command runs ``bootstrap_demo`` (demo tenant, key, ``sim-small`` on the
``sim-local`` pool, the ``sim-embed`` embedding model on ``sim-embed-local``) and then
``serve``. Here the same rows are made, a real gateway and pool
worker serve them, and the printed curl line and the printed Python (the official ``openai``
client) are run exactly as a newcomer would paste them.
"""

from __future__ import annotations

import io
import itertools
import json
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from django.core.management import call_command

from tests import procs

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

WORKER_ID = "quickstart-w1"
EMBED_WORKER_ID = "quickstart-e1"


@pytest.fixture
def gateway(redis_client) -> Iterator[tuple[str, str]]:
    """(base URL, what bootstrap_demo printed), with the demo pool served for real."""
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    out = io.StringIO()
    call_command("bootstrap_demo", "--base-url", url, stdout=out)
    worker = procs.start_worker("sim-local", worker_id=WORKER_ID)
    embedder = procs.start_worker("sim-embed-local", worker_id=EMBED_WORKER_ID)
    server, _ = procs.start_uvicorn(port=port)
    try:
        procs.wait_for_worker(redis_client, "sim-local", WORKER_ID, worker)
        procs.wait_for_worker(redis_client, "sim-embed-local", EMBED_WORKER_ID, embedder)
        procs.wait_for_http(url + "/healthz", server)
        yield url, out.getvalue()
    finally:
        server.stop()
        worker.stop()
        embedder.stop()


def test_the_printed_curl_line_and_python_stream_a_completion(gateway) -> None:
    url, printed = gateway
    assert url in printed
    key = re.search(r"\(shown once\): (\S+)", printed).group(1)
    assert key in printed.split("curl", 1)[1]  # the examples carry the new key

    curl = re.search(r"^  (curl .*?)\n(?=or with)", printed, re.S | re.M).group(1)
    args = shlex.split(curl.replace("\\\n", " "))
    got = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout
    events = [line for line in got.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 3
    assert '"content"' in got and "chat.completion.chunk" in got

    after = printed.split("(.venv/bin/python):\n", 1)[1].splitlines()
    block = list(itertools.takewhile(lambda line: line.startswith("  "), after))
    python = textwrap.dedent("\n".join(block))
    ran = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True,
                         timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert len(ran.stdout.split()) >= 3  # words of the simulated model's text

    # The demo ships an embedding model: the printed embeddings line works too.
    lines = printed.split("Embed text with the embedding model:\n", 1)[1].splitlines()
    curl = "\n".join(itertools.takewhile(lambda line: line.startswith("  "), lines))
    args = shlex.split(curl.replace("\\\n", " "))
    got = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout
    answer = json.loads(got)
    assert answer["model"] == "sim-embed" and len(answer["data"][0]["embedding"]) == 384
