"""deploy/monitoring: the Prometheus alert rules and the Grafana dashboard are well formed and
name only series the gateway exports (no promtool or Grafana here: checked by structure, and
against what ``metering.metrics.render`` really writes). yamllint runs on the rules file in
tests/test_deploy.py::test_yaml_lints like every deploy/ YAML."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from infra import quietlog
from infra.redis_conn import get_redis
from metering import fairness, metrics, overhead
from metering.keys import pools_key
from tests.factories import make_tenant
from tests.prom import samples

MONITORING = Path(__file__).resolve().parent.parent / "deploy" / "monitoring"
RULES = MONITORING / "alerts.yaml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
SERIES = re.compile(r"\b(igw_[a-z0-9_]+)")


@pytest.fixture(scope="module")
def exported(django_db_setup, django_db_blocker) -> set[str]:
    """Every series name /metrics writes once each kind of figure has data."""
    with django_db_blocker.unblock():
        r = get_redis()
        tenant = make_tenant("mon-tenant")
        r.sadd(pools_key(), "mon-pool")
        r.hset(fairness.weights_key("mon-pool"), str(tenant.pk), 1)
        r.zadd(fairness.heads_key("mon-pool"), {str(tenant.pk): 1})
        import time

        now = int(time.time())
        r.hset(fairness.service_key("mon-pool", now - 1), str(tenant.pk), 10)
        r.lpush(fairness.samples_key("mon-pool", tenant.pk), f"{now - 1},0,50", f"{now},500,900")
        r.hset(overhead.overhead_key(), mapping={"mon-pool|1": 1, "mon-pool|sum_ms": 1,
                                                 "mon-pool|count": 1})
        r.hset(quietlog.counts_key(), "upstream_usage_differs", 1)
        metrics.count_rejection(r, tenant.pk, "m", "tokens")
        text = metrics.render(r)
        tenant.delete()
    return {name for name, _ in samples(text)}


def expressions(obj: object) -> list[str]:
    if isinstance(obj, dict):
        found = [obj["expr"]] if isinstance(obj.get("expr"), str) else []
        return found + [e for v in obj.values() for e in expressions(v)]
    if isinstance(obj, list):
        return [e for v in obj for e in expressions(v)]
    return []


def check_expr(expr: str, exported: set[str]) -> None:
    assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    for name in SERIES.findall(expr):
        assert name in exported, f"{name} is not exported (in {expr!r})"


def test_rules_are_well_formed_and_name_exported_series(exported):
    doc = yaml.safe_load(RULES.read_text())
    groups = doc["groups"]
    assert len({g["name"] for g in groups}) == len(groups)
    alerts = set()
    for group in groups:
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "record", "expr", "for", "labels", "annotations"}
            assert ("alert" in rule) != ("record" in rule)
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            check_expr(rule["expr"], exported)
            if "for" in rule:
                assert DURATION.match(rule["for"]), rule["for"]
            for kv in (rule.get("labels", {}), rule.get("annotations", {})):
                assert all(isinstance(k, str) and isinstance(v, str) for k, v in kv.items())
            alerts.add(rule.get("alert"))
    assert len(alerts) == sum(len(g["rules"]) for g in groups)  # unique names
    share = next(r for g in groups for r in g["rules"] if r.get("alert") == "TenantBelowFairShare")
    # The alert: a backlogged tenant below 80% of its share for 5 minutes.
    assert "igw_fair_share_ratio < 0.8" in share["expr"] and "igw_fair_backlogged" in share["expr"]
    assert share["for"] == "5m"


def test_dashboard_is_well_formed_and_names_exported_series(exported):
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"pool", "datasource"} <= variables
    for panel in panels:
        assert panel["type"] in {"timeseries", "stat", "bargauge", "gauge", "table"}
        box = panel["gridPos"]
        assert all(isinstance(box[k], int) for k in "xywh")
        assert box["x"] >= 0 and box["x"] + box["w"] <= 24 and box["h"] > 0
        assert panel["targets"] and len({t["refId"] for t in panel["targets"]}) == len(
            panel["targets"])
        for expr in expressions(panel):
            check_expr(expr, exported)
            for var in re.findall(r"\$(\w+)", expr):
                assert var in variables, var
    for expr in expressions(dash["templating"]):
        check_expr(expr.replace("label_values(", "("), exported)
    fairness_panels = [p for p in panels if "igw_fair_" in json.dumps(p["targets"])]
    assert len(fairness_panels) >= 5  # shares, ratio, diff, queue wait, TTFT


def test_the_checks_catch_a_series_that_does_not_exist(exported):
    with pytest.raises(AssertionError):
        check_expr("igw_fair_no_such_series > 1", exported)
    with pytest.raises(AssertionError):
        check_expr("sum(rate(igw_gateway_overhead_seconds_bucket[5m])", exported)
