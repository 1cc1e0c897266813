"""The embedded Redis: ``manage.py serve`` takes over a server an earlier command daemonized."""

from __future__ import annotations

import contextlib
import subprocess

import psutil
import pytest
import redis

from infra import embedded_redis


@pytest.mark.integration
def test_serve_takes_over_a_daemonized_server_and_its_port(tmp_path) -> None:
    url = embedded_redis.ensure_embedded_redis(tmp_path)  # as bootstrap_demo would
    daemon = int((tmp_path / "redis.pid").read_text())
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        assert embedded_redis.take_over(tmp_path) == port
        assert not psutil.pid_exists(daemon) or \
            psutil.Process(daemon).status() == psutil.STATUS_ZOMBIE
        assert not embedded_redis.answers(url)
        # serve's own server, in the foreground, on the same port.
        child = subprocess.Popen(embedded_redis.server_command(tmp_path, port, daemonize=False),
                                 stdout=subprocess.DEVNULL)
        try:
            embedded_redis.wait_answering(url, "its output")
            embedded_redis.record(tmp_path, port)
            assert embedded_redis.ensure_embedded_redis(tmp_path) == url  # found, not started
            embedded_redis.forget(tmp_path, port)
            assert not (tmp_path / "redis.port").exists()
        finally:
            child.terminate()
            child.wait(10)
    finally:
        if embedded_redis.answers(url):
            with contextlib.suppress(redis.RedisError):
                redis.Redis.from_url(url).shutdown(nosave=True)
