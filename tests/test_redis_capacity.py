"""The Redis shard and cell planner's arithmetic (catalog.redis_capacity, manage.py plan_redis)."""

from __future__ import annotations

import json
import math

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from catalog.redis_capacity import RedisCost, RedisPlanError, plan_redis, solve_cost

# 8 us per token, 800 us per request: with 320 tokens per request, 10.5 us per token in all.
COST = RedisCost(cpu_s_per_request=800e-6, cpu_s_per_token=8e-6, commands_per_request=100,
                 commands_per_token=1.5)


def test_solving_two_runs_recovers_the_parts_exactly() -> None:
    def run(requests: float, per_req_tokens: float) -> dict[str, float]:
        tokens = requests * per_req_tokens
        return {"requests": requests, "tokens": tokens,
                "cpu_s": requests * 800e-6 + tokens * 8e-6,
                "commands": requests * 100 + tokens * 1.5}

    cost = solve_cost(run(200, 4), run(300, 128))
    assert cost.cpu_s_per_request == pytest.approx(800e-6)
    assert cost.cpu_s_per_token == pytest.approx(8e-6)
    assert cost.commands_per_request == pytest.approx(100)
    assert cost.commands_per_token == pytest.approx(1.5)


def test_runs_that_do_not_differ_in_tokens_per_request_cannot_be_solved() -> None:
    same = {"requests": 100, "tokens": 400, "cpu_s": 0.1, "commands": 1000}
    with pytest.raises(RedisPlanError, match="differ"):
        solve_cost(same, {k: 2 * v for k, v in same.items()})


def test_the_designs_two_million_tokens_a_minute() -> None:
    p = plan_redis(COST, output_tpm=2e6, tokens_per_request=320)
    assert p.tokens_per_s == pytest.approx(33_333.33, rel=1e-6)
    assert p.requests_per_s == pytest.approx(33_333.33 / 320, rel=1e-6)
    # 33,333 x 8 us + 104.2 x 800 us = 0.2667 + 0.0833 = 0.35 cores
    assert p.redis_cores == pytest.approx(0.35, rel=1e-6)
    assert p.commands_per_s == pytest.approx(33_333.33 * 1.5 + 104.1667 * 100, rel=1e-5)
    assert p.shards == 1  # 0.35 of a core fits under the 0.5 target
    # 0.5 core / 10.5 us per token
    assert p.tokens_per_s_per_shard == pytest.approx(0.5 / 10.5e-6)
    assert p.replicas == 11  # 33,333 / 3,040 = 10.96
    assert p.cells == 1


def test_the_designs_twenty_million_tokens_a_minute() -> None:
    p = plan_redis(COST, output_tpm=2e7, tokens_per_request=320)
    assert p.redis_cores == pytest.approx(3.5, rel=1e-6)
    assert p.shards == 7  # 3.5 / 0.5 exactly: no extra shard for rounding noise
    assert p.replicas == 110  # the design's "about 110 replicas"
    assert p.cells == 7  # one Redis primary per cell, Redis needs more cells than GPUs do


def test_cells_follow_replicas_when_redis_is_not_the_limit() -> None:
    p = plan_redis(COST, output_tpm=2e7, tokens_per_request=320, shard_cpu=1.0,
                   max_replicas_per_cell=20)
    assert p.shards == 4  # ceil(3.5)
    assert p.cells == math.ceil(110 / 20) == 6


def test_cells_with_redis_cluster_and_regions() -> None:
    # 7 shards; with Redis Cluster a cell may run 4 primaries: Redis needs 2 cells, GPUs 3.
    p = plan_redis(COST, output_tpm=2e7, tokens_per_request=320, shards_per_cell=4,
                   max_replicas_per_cell=50)
    assert (p.cells_for_redis, p.cells_for_replicas, p.cells) == (2, 3, 3)
    # Three regions need a cell each even when one would carry the load.
    small = plan_redis(COST, output_tpm=2e6, tokens_per_request=320, regions=3)
    assert (small.cells_for_redis, small.cells_for_replicas, small.cells) == (1, 1, 3)
    with pytest.raises(RedisPlanError):
        plan_redis(COST, output_tpm=2e6, tokens_per_request=320, shards_per_cell=0)


@pytest.mark.parametrize("kwargs", [
    {"output_tpm": 0, "tokens_per_request": 300},
    {"output_tpm": 1e6, "tokens_per_request": 0.5},
    {"output_tpm": 1e6, "tokens_per_request": 300, "shard_cpu": 1.5},
    {"output_tpm": 1e6, "tokens_per_request": 300, "shard_cpu": 0},
    {"output_tpm": float("nan"), "tokens_per_request": 300},
])
def test_bad_inputs_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(RedisPlanError):
        plan_redis(COST, **kwargs)


def test_a_cost_must_be_measured() -> None:
    with pytest.raises(RedisPlanError):
        RedisCost(0, 0, 1, 1)
    with pytest.raises(RedisPlanError):
        RedisCost(-1e-6, 1e-6, 1, 1)
    with pytest.raises(RedisPlanError, match="cpu_s_per_token"):
        RedisCost.from_dict({"cpu_s_per_request": 1, "commands_per_request": 1,
                             "commands_per_token": 1})


def test_command_reads_a_measured_cost(tmp_path, capsys) -> None:
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"cost": COST.__dict__}))
    call_command("plan_redis", "--cost", str(path), "--tokens-per-request", "320", "--json")
    out = json.loads(capsys.readouterr().out)
    assert [p["shards"] for p in out["plans"]] == [1, 7]
    assert [p["cells"] for p in out["plans"]] == [1, 7]
    call_command("plan_redis", "--cpu-us-per-request", "800", "--cpu-us-per-token", "8",
                 "--tokens-per-request", "320", "--demand-tpm", "2e7")
    assert "7 shard(s)" in capsys.readouterr().out
    call_command("plan_redis", "--cpu-us-per-request", "800", "--cpu-us-per-token", "8",
                 "--tokens-per-request", "320", "--demand-tpm", "2e7", "--shards-per-cell", "4",
                 "--regions", "2", "--json")
    (plan,) = json.loads(capsys.readouterr().out)["plans"]
    assert (plan["shards"], plan["cells_for_redis"], plan["cells"]) == (7, 2, 3)


def test_command_without_a_cost_says_what_to_give() -> None:
    with pytest.raises(CommandError, match="--cost"):
        call_command("plan_redis")
