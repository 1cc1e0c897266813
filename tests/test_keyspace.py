"""One owner of the serving core's Redis key layout (``infra.keyspace``; ADR 0028).

A key built by hand elsewhere drifts from the scripts that write it (a reader of a renamed key
reads nothing, silently). So no module outside ``infra/keyspace.py`` spells the kinds below.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "serving", "workers", "tenants", "metering", "infra")
# key("wfq", ...), pool_key("req", ...), tenant_key("bucket", ...) and the like
HAND_BUILT = re.compile(
    r"""\b(?:key|pool_key|tenant_key)\(\s*["'](?:wfq|req|stream|deadlines|workers|worker|wake|"""
    r"""bucket|conc|streams|charges|pools)["']""")


def test_the_serving_cores_keys_are_built_only_in_infra_keyspace() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
        if path != ROOT / "infra" / "keyspace.py"
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if HAND_BUILT.search(line)
    ]
    assert offenders == []
