"""The capacity planner reproduces the design's "Capacity estimate" figure by figure."""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from catalog.capacity import PlanError, PlanInput, input_for_pool, plan
from tests.factories import make_model, make_pool

# The design's hypothetical model: 8B parameters, 32 layers, 8 KV heads, head dim 128, 16-bit.
DESIGN = PlanInput(layers=32, kv_heads=8, head_dim=128, bytes_per_value=2, parameters=8e9,
                   gpu_gb=80, kv_budget_gb=50, avg_context=4000, decode_tps=32,
                   demand_tpm=2_000_000, spare=2)


def test_kv_cache_per_token_is_128_kib() -> None:
    assert plan(DESIGN).kv_bytes_per_token == 131_072 == 128 * 1024


def test_check_yourself_40_layers_is_160_kib() -> None:
    p = PlanInput(layers=40, kv_heads=8, head_dim=128, bytes_per_value=2, kv_budget_gb=50)
    assert plan(p).kv_bytes_per_token == 163_840 == 160 * 1024


def test_weights_and_about_381000_tokens_in_memory() -> None:
    result = plan(DESIGN)
    assert result.weights_bytes == 16e9
    assert result.tokens_in_memory == 381_469  # 50e9 / 131,072
    assert round(result.tokens_in_memory, -3) == 381_000


def test_sequences_collapse_as_contexts_grow() -> None:
    result = plan(DESIGN)
    assert result.sequences == 95
    assert result.ladder == {4_000: 95, 8_000: 47, 16_000: 23, 32_000: 11, 128_000: 2}


def test_11_replicas_plus_2_spares_for_2_million_tokens_per_minute() -> None:
    result = plan(DESIGN)
    assert result.replica_tokens_per_s == 95 * 32 == 3_040
    assert round(result.demand_tokens_per_s) == 33_333
    assert result.replicas == 11
    assert result.total_replicas == 13
    # "The same answer falls out of memory": ~1,042 streams / 95 per replica.
    assert result.concurrent_streams == 1_042
    assert result.replicas_by_memory == 11


def test_a_128k_prompt_takes_16_8_gb_and_displaces_about_32_sequences() -> None:
    result = plan(DESIGN)
    assert result.long_prompt_bytes == 128_000 * 131_072
    assert round(result.long_prompt_bytes / 1e9, 1) == 16.8
    assert round(result.long_prompt_share, 2) == 0.34  # "a third of the KV budget"
    assert round(result.long_prompt_displaces) == 32


def test_ten_times_the_demand_needs_about_110_replicas() -> None:
    result = plan(PlanInput(**{**DESIGN.__dict__, "demand_tpm": 20_000_000}))
    assert result.replicas == 110  # "What changes at 10x"


def test_the_derived_kv_budget_matches_the_designs_50_gb() -> None:
    # vLLM's default 0.9 utilisation of 80 GB, minus 16 GB of weights and 6 GB of overhead.
    derived = plan(PlanInput(**{**DESIGN.__dict__, "kv_budget_gb": None}))
    assert derived.kv_budget_derived
    assert derived.kv_budget_bytes == pytest.approx(50e9)
    assert derived.tokens_in_memory == 381_469


@pytest.mark.parametrize(("change", "message"), [
    ({"parameters": 50e9}, "do not fit"),  # 100 GB of weights on an 80 GB accelerator
    ({"kv_budget_gb": None, "parameters": 34e9}, "no memory left"),  # 72 - 68 - 6
    ({"avg_context": 400_000}, "not one sequence"),
    ({"layers": 0}, "layers"),
    ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization"),
])
def test_impossible_deployments_are_explained(change: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan(PlanInput(**{**DESIGN.__dict__, **change}))


def test_a_max_model_len_beyond_the_kv_cache_is_flagged() -> None:
    result = plan(PlanInput(**{**DESIGN.__dict__, "max_model_len": 500_000}))
    assert any("max_model_len" in w for w in result.warnings)


# -- management command ----------------------------------------------------------------------


def run_command(*args: str) -> str:
    out = StringIO()
    call_command("plan_capacity", *args, stdout=out)
    return out.getvalue()


DESIGN_FLAGS = ("--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--bytes", "2",
                "--params", "8e9", "--gpu-gb", "80", "--kv-budget-gb", "50",
                "--avg-context", "4000", "--decode-tps", "32", "--demand-tpm", "2000000",
                "--spare", "2")


def test_the_command_prints_the_designs_figures() -> None:
    text = run_command(*DESIGN_FLAGS)
    for figure in ("131,072 bytes = 128 KiB", "381,469", "at 4,000 tokens: 95",
                   "32,000 -> 11", "128,000 -> 2", "3,040", "-> 11 replicas",
                   "with 2 spare: 13 replicas", "16.8 GB", "about 32"):
        assert figure in text, figure


def test_the_command_prints_json_for_scripts() -> None:
    figures = json.loads(run_command(*DESIGN_FLAGS, "--json"))
    assert (figures["kv_kib_per_token"], figures["sequences"], figures["total_replicas"]) == (
        128, 95, 13)


def test_the_command_needs_a_geometry_or_a_pool() -> None:
    with pytest.raises(CommandError, match="--layers"):
        run_command("--kv-heads", "8")
    with pytest.raises(CommandError, match="do not fit"):
        run_command(*DESIGN_FLAGS, "--params", "80e9")


@pytest.mark.django_db
def test_the_command_reads_a_pools_model_geometry() -> None:
    model = make_model("llama-ish-40", num_layers=40, num_kv_heads=8, head_dim=128,
                       bytes_per_value=2, parameter_count=13_000_000_000)
    make_pool(model, name="gpu-pool", backend_settings={"capacity": {"kv_budget_gb": 40,
                                                                     "decode_tps": 25}})
    text = run_command("--pool", "gpu-pool")
    assert "163,840 bytes = 160 KiB" in text
    assert "26.0 GB" in text  # 13e9 parameters x 2 bytes
    assert "244,140" in text  # 40e9 / 163,840
    overridden = json.loads(run_command("--pool", "gpu-pool", "--avg-context", "8000", "--json"))
    assert overridden["sequences"] == 244_140 // 8000
    with pytest.raises(CommandError, match="no pool"):
        run_command("--pool", "missing")


@pytest.mark.django_db
def test_unknown_capacity_settings_on_a_pool_are_named() -> None:
    pool = make_pool(make_model(), backend_settings={"capacity": {"gpu_gigs": 80}})
    with pytest.raises(PlanError, match="gpu_gigs"):
        input_for_pool(pool)


# -- admin section -----------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_pool_admin_section_shows_the_plan(rf: Any, admin_user: Any) -> None:
    from django.contrib import admin

    from catalog.admin_planner import capacity_plan_html
    from catalog.models import Pool
    from workers.admin import PoolAdmin

    pool = make_pool(make_model("design-8b"), backend_settings={"capacity": {"kv_budget_gb": 50}})
    html = str(capacity_plan_html(pool))
    assert "131,072 bytes (128 KiB)" in html and "381,469" in html
    assert "11 + 2 spare = 13" in html

    model_admin = PoolAdmin(Pool, admin.site)  # the registered admin carries the plan
    request = rf.get(f"/admin/catalog/pool/{pool.pk}/change/")
    request.user = admin_user
    response = model_admin.change_view(request, str(pool.pk))
    response.render()
    page = response.content.decode()
    assert "Capacity plan" in page and "381,469" in page
    # Read-only: the plan is not a form field the operator could submit.
    assert 'name="capacity_plan"' not in page


@pytest.mark.django_db
def test_the_admin_section_explains_a_pool_it_cannot_plan() -> None:
    from catalog.admin_planner import capacity_plan_html

    pool = make_pool(make_model("huge", parameter_count=90_000_000_000))
    assert "No plan" in str(capacity_plan_html(pool))
