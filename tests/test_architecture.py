"""The package layering of docs/architecture.md, checked from the imports themselves.

Every module of the project's packages is parsed with ``ast`` (nothing is imported), and:

- an import between two top-level packages follows an allowed direction, so no two packages
  depend on each other;
- the catalog imports nothing of the project but ``infra``, and no app registers code into a
  lower package when it starts;
- the serving core imports no HTTP app and not the worker host;
- inside ``gateway``, the wiring (settings, URLs, ASGI, Celery) sits above the HTTP apps, and
  the apps above the HTTP plumbing they share, with no two-way pair;
- no project module is imported inside a function: such an import hides a dependency, usually
  one that would close a cycle; the module belongs elsewhere.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "serving", "workers", "tenants", "catalog", "metering", "infra")

# What each top-level package may import (besides itself). Read it bottom-up: infra knows
# nothing, the catalog keeps the models, pools and routes, tenants and metering keep the
# tenancy and usage records, serving is the hot path over Redis, workers host the engines,
# gateway is the HTTP layer and the project's wiring.
ALLOWED: dict[str, set[str]] = {
    "infra": set(),
    # A pool names its tenant by the string "tenants.Tenant": a relation, not an import.
    "catalog": {"infra"},
    "tenants": {"infra", "catalog"},
    "metering": {"infra", "catalog", "tenants"},
    "serving": {"infra", "catalog", "tenants", "metering"},
    "workers": {"infra", "catalog", "tenants", "serving"},
    # Only the wiring may name the worker package (test below): the HTTP apps count tokens and
    # resolve adapters with serving.tokenization and serving.adapters, as the engines do.
    "gateway": {"infra", "catalog", "tenants", "metering", "serving", "workers"},
}

HTTP_APPS = ("gateway.inference", "gateway.api", "gateway.portal", "gateway.contentlog")
# The project's wiring: it imports the apps to mount them, so no app may import it.
GATEWAY_WIRING = ("gateway", "gateway.settings", "gateway.urls", "gateway.asgi",
                  "gateway.routing", "gateway.celery")

# Edges being removed on other branches right now; the lead empties this at merge.
PENDING_EDGES: set[tuple[str, str]] = set()

# Imports inside functions that other branches are removing (same merge note as above), as
# (importing module, imported module).
PENDING_LOCAL_IMPORTS: set[tuple[str, str]] = set()

# Imports inside functions that are not hiding a cycle, with the reason.
ALLOWED_LOCAL_IMPORTS: dict[tuple[str, str], str] = {
    ("tenants.apps", "tenants.signals"):
        "Django connects signal receivers in AppConfig.ready(), after the registry is loaded",
    ("gateway.portal.apps", "gateway.portal.views.invitations"):
        "the sign-in receiver is connected in AppConfig.ready(), after the registry is loaded",
    ("gateway.portal.views.home", "gateway.sso"):
        "enterprise sign-in is optional: guarded by ImportError",
    ("gateway.portal.views.content_logging", "gateway.contentlog.breakglass"):
        "the content log is an optional app: guarded by apps.is_installed",
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module (for ``from m import name``: m.name when that is one)
    line: int
    in_function: bool


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> frozenset[str]:
    return frozenset(_module_name(p) for p in _sources())


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if "migrations" not in p.parts)


def _type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _walk(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child):
            continue  # annotations only: never imported at run time
        inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
        yield child, inside
        yield from _walk(child, inside)


def _targets(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level or node.module is None:
        return []  # relative imports stay inside their package
    # ``from serving import wfq`` names the module serving.wfq, not the package serving.
    submodules = [f"{node.module}.{a.name}" for a in node.names
                  if f"{node.module}.{a.name}" in _modules()]
    return submodules or [node.module]


@cache
def imports() -> tuple[Import, ...]:
    found = []
    for path in _sources():
        module = _module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, in_function in _walk(tree, False):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(node):
                    if target.split(".")[0] in PACKAGES:
                        found.append(Import(module, target, node.lineno, in_function))
    return tuple(found)


def top(module: str) -> str:
    return module.split(".")[0]


def gateway_unit(module: str) -> str:
    """Which part of ``gateway`` a module belongs to: an HTTP app, the wiring, or plumbing."""
    for app in HTTP_APPS:
        if module == app or module.startswith(app + "."):
            return app
    return "gateway (wiring)" if module in GATEWAY_WIRING else "gateway (plumbing)"


def _where(imp: Import) -> str:
    return f"{imp.module.replace('.', '/')}.py:{imp.line} imports {imp.target}"


def test_the_scan_sees_the_project() -> None:
    found = {(i.module, i.target) for i in imports()}
    assert ("serving.submission", "serving.admission") in found
    assert ("workers.host", "serving.wfq") in found
    assert ("tenants.models", "catalog.models") in found
    assert len(_modules()) > 100


def test_packages_import_only_in_allowed_directions() -> None:
    wrong = [_where(i) for i in imports()
             if top(i.target) != top(i.module) and top(i.target) not in ALLOWED[top(i.module)]]
    assert not wrong, "imports against the layering (docs/architecture.md):\n" + "\n".join(wrong)


def test_allowed_directions_have_no_cycle() -> None:
    def reaches(start: str, goal: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt}))
                   for nxt in ALLOWED[start])

    assert not [p for p in ALLOWED if reaches(p, p)]


def test_no_two_packages_import_each_other() -> None:
    edges = {(top(i.module), top(i.target)) for i in imports()}
    pairs = sorted({tuple(sorted(e)) for e in edges if e[0] != e[1] and e[::-1] in edges})
    assert not pairs


def test_the_serving_core_imports_no_http_app_and_not_the_worker_host() -> None:
    wrong = [_where(i) for i in imports() if top(i.module) == "serving"
             and (top(i.target) == "gateway" or i.target.startswith("workers"))]
    assert not wrong


def test_the_catalog_imports_only_infra_and_registers_nothing_from_above() -> None:
    """The catalog is a floor of its own below tenants: its modules read Django and ``infra``
    only, and no package above hands it code to call (an ``AppConfig.ready()`` registering a
    checker or a reader is how the old ``tenants.pool_status``/``pool_settings`` hooks worked;
    what needs the engines or the queue now lives above: ``workers.admin``,
    ``serving.pool_status``)."""
    wrong = [_where(i) for i in imports()
             if top(i.module) == "catalog" and top(i.target) not in {"catalog", "infra"}]
    assert not wrong, "the catalog imports above its floor:\n" + "\n".join(wrong)
    # A hook is an app's ready() importing a lower package's code to hand it down.
    hooks = [_where(i) for i in imports() if i.in_function and i.module.endswith(".apps")
             and top(i.target) != top(i.module)]
    assert not hooks, "an app registers code into a lower package:\n" + "\n".join(hooks)


def test_the_catalog_keeps_its_tables_and_tenants_keep_no_catalog_model() -> None:
    """The models moved without their tables (ADR 0030): each keeps the table the tenants app
    made, and no catalog model is defined in ``tenants`` again."""
    source = (ROOT / "catalog" / "models.py").read_text()
    for table in ("tenants_servedmodel", "tenants_pool", "tenants_route", "tenants_routetarget"):
        assert f'db_table = "{table}"' in source
    tenants = {node.name for p in (ROOT / "tenants").glob("*models.py")
               for node in ast.parse(p.read_text()).body if isinstance(node, ast.ClassDef)}
    assert not tenants & {"ServedModel", "Pool", "Route", "RouteTarget"}


def test_no_http_app_imports_the_workers() -> None:
    """The HTTP layer stops at the serving core: what it shares with the engines (sampling
    parameters, the tokenizer, the adapter catalog, the schema check) lives in ``serving``."""
    wrong = [_where(i) for i in imports()
             if gateway_unit(i.module) in HTTP_APPS and top(i.target) == "workers"]
    assert not wrong, "an HTTP app imports the worker package:\n" + "\n".join(wrong)


def test_inside_gateway_no_two_parts_import_each_other() -> None:
    edges = {(gateway_unit(i.module), gateway_unit(i.target)) for i in imports()
             if top(i.module) == top(i.target) == "gateway"}
    edges -= PENDING_EDGES
    pairs = sorted({tuple(sorted(e)) for e in edges if e[0] != e[1] and e[::-1] in edges})
    assert not pairs


def test_no_http_app_imports_the_wiring_and_the_api_not_the_portal() -> None:
    wrong = [_where(i) for i in imports()
             if gateway_unit(i.module) in HTTP_APPS
             and gateway_unit(i.target) == "gateway (wiring)" and top(i.target) == "gateway"]
    wrong += [_where(i) for i in imports()
              if gateway_unit(i.module) == "gateway.api"
              and gateway_unit(i.target) == "gateway.portal"
              and (gateway_unit(i.module), gateway_unit(i.target)) not in PENDING_EDGES]
    assert not wrong


def test_no_project_module_is_imported_inside_a_function() -> None:
    local = [i for i in imports() if i.in_function]
    wrong = [_where(i) for i in local if (i.module, i.target) not in PENDING_LOCAL_IMPORTS
             and (i.module, i.target) not in ALLOWED_LOCAL_IMPORTS]
    assert not wrong, ("move the code to the module it belongs in instead of hiding the "
                       "dependency in a function:\n" + "\n".join(wrong))


def test_the_exemption_lists_are_still_needed() -> None:
    local = {(i.module, i.target) for i in imports() if i.in_function}
    stale = (set(ALLOWED_LOCAL_IMPORTS) | PENDING_LOCAL_IMPORTS) - local
    assert not stale, f"no longer imported inside a function: drop {sorted(stale)}"


@pytest.mark.integration
def test_the_celery_app_loads_before_django_is_set_up() -> None:
    """``celery -A gateway`` imports the package before Django's set-up: the app must name the
    engine host and the periodic tasks, not import them (they import models)."""
    code = ("import gateway; from gateway.celery import app; "
            "assert 'workers.host:EngineHostStep' in app.steps['worker']; "
            "assert {'workers.janitor_sweep', 'metering.flush_usage'} <= "
            "{e['task'] for e in app.conf.beat_schedule.values()}")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
