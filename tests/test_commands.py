"""Management commands: the whole tenant and key flow from the shell, and bad input refused."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from catalog.models import Pool, ServedModel
from tenants.auth import AuthError, authenticate, clear_cache
from tenants.models import ApiKey, Quota, Tenant, Tier
from tests.factories import bearer, make_key, make_model, make_tenant

ROOT = Path(__file__).resolve().parent.parent
KEY_RE = re.compile(r"igw_[0-9A-Za-z]{43}_[0-9A-Za-z]{6}")


@pytest.fixture(autouse=True)
def _fresh_cache(redis_client):
    clear_cache()


def run(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


# --- create_tenant ----------------------------------------------------------------------------

@pytest.mark.django_db
def test_create_tenant_with_tier_region_and_quota():
    out, _ = run("create_tenant", "acme", "--name", "Acme Corp", "--tier", "gold",
                 "--weight", "3", "--region", "eu-west", "--input-tpm", "500000",
                 "--max-output-tokens", "2048", "--ttft-deadline", "2", "--total-deadline", "90")
    tenant = Tenant.objects.get(slug="acme")
    assert (tenant.name, tenant.region, tenant.tier.name, tenant.tier.weight) == (
        "Acme Corp", "eu-west", "gold", 3.0)
    quota = Quota.objects.get(tenant=tenant, model=None)
    assert (quota.input_tpm, quota.max_output_tokens) == (500_000, 2048)
    assert (quota.ttft_deadline_s, quota.total_deadline_s, quota.output_tpm) == (2.0, 90.0, None)
    assert "Created tenant acme" in out
    # A second tenant on the existing tier, without restating the weight.
    run("create_tenant", "globex", "--tier", "gold")
    assert Tier.objects.filter(name="gold").count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("args,message", [
    (["Not A Slug"], "slug"),
    (["dup"], "already exists"),
    (["t1", "--input-tpm", "-5"], "--input-tpm: input tpm must be greater than zero"),
    (["t1", "--open-streams", "0"], "--open-streams"),
    (["t1", "--input-burst", "0"], "--input-burst"),
    (["t1", "--ttft-deadline", "120", "--total-deadline", "60"], "--ttft-deadline"),
    (["t1", "--output-tpm", "100"], "--output-burst"),
    (["t1", "--weight", "0"], "--weight must be at least 0.01"),
    (["t1", "--tier", "existing", "--weight", "5"], "exists with weight 1"),
    (["t1", "--input-tpm", "lots"], "invalid int value"),
])
def test_create_tenant_rejects_bad_input(args, message):
    make_tenant("dup")
    Tier.objects.create(name="existing", weight=1)
    before = Tenant.objects.count()
    with pytest.raises(CommandError, match=re.escape(message)):
        run("create_tenant", *args)
    assert Tenant.objects.count() == before


# --- issue_key ------------------------------------------------------------------------------

@pytest.mark.django_db
def test_issue_key_prints_only_the_key_on_stdout():
    tenant = make_tenant("acme")
    model = make_model("sim-small")
    out, err = run("issue_key", "acme", "--name", "ci", "--models", "sim-small",
                   "--expires-in-days", "30", "--output-tpm", "1000")
    assert KEY_RE.fullmatch(out.strip()) and out.count("\n") == 1
    plaintext = out.strip()
    api_key = ApiKey.objects.get(name="ci")
    assert api_key.masked in err and plaintext not in err
    assert list(api_key.allowed_models.all()) == [model]
    assert api_key.output_tpm == 1000 and api_key.expires_at is not None
    principal = authenticate(bearer(plaintext))
    assert principal.tenant_id == tenant.pk and principal.allowed_model_names == {"sim-small"}


@pytest.mark.django_db
@pytest.mark.parametrize("args,message", [
    (["nobody"], "no tenant with slug 'nobody'"),
    (["acme", "--models", "sim-small,ghost"], "no such model(s): ghost"),
    (["acme", "--expires-in-days", "-1"], "--expires-in-days must be above 0"),
    (["acme", "--input-tpm", "999999999"], "above the tenant's"),
    (["acme", "--concurrent-requests", "0"], "--concurrent-requests"),
    (["acme", "--name", "  "], "--name must be 1-100 characters"),
])
def test_issue_key_rejects_bad_input(args, message):
    make_tenant("acme")
    make_model("sim-small")
    with pytest.raises(CommandError, match=re.escape(message)):
        run("issue_key", *args)
    assert not ApiKey.objects.exists()


# --- revoke_key -----------------------------------------------------------------------------

@pytest.mark.django_db
@pytest.mark.parametrize("ref", ["id", "prefix", "key"])
def test_revoke_key_by_id_prefix_or_key(ref):
    api_key, plaintext = make_key()
    keep, keep_plain = make_key(api_key.tenant)
    assert authenticate(bearer(plaintext))  # cached: the revoke must still win
    arg = {"id": str(api_key.pk), "prefix": api_key.prefix, "key": plaintext}[ref]
    out, _ = run("revoke_key", arg)
    assert f"Revoked key {api_key.masked}" in out and plaintext not in out
    with pytest.raises(AuthError):
        authenticate(bearer(plaintext))
    assert authenticate(bearer(keep_plain)).key_id == keep.pk
    with pytest.raises(CommandError, match="already revoked"):
        run("revoke_key", arg)


@pytest.mark.django_db
@pytest.mark.parametrize("arg,message", [
    ("999999", "no API key matches"),
    ("igw_zzzzzzzz", "no API key matches"),
    ("igw", "at least 6 characters"),
])
def test_revoke_key_rejects_unknown_refs(arg, message):
    make_key()
    with pytest.raises(CommandError, match=message):
        run("revoke_key", arg)


@pytest.mark.django_db
def test_revoke_key_refuses_an_ambiguous_prefix():
    first, _ = make_key()
    second, _ = make_key(first.tenant)
    # Display prefixes rarely collide; make two do so, as a short typed prefix would.
    ApiKey.objects.filter(pk=second.pk).update(prefix=first.prefix)
    with pytest.raises(CommandError, match="2 keys match"):
        run("revoke_key", first.prefix[:8])
    assert not ApiKey.objects.filter(revoked_at__isnull=False).exists()


# --- models and pools ------------------------------------------------------------------------

@pytest.mark.django_db
def test_create_and_change_a_model_and_its_pools():
    out, _ = run("create_model", "sim-embed-2", "--task", "embed", "--max-model-len", "4096")
    model = ServedModel.objects.get(name="sim-embed-2")
    assert (model.task, model.max_model_len, model.engine_model_id, model.tokenizer_path) == (
        "embed", 4096, "sim-embed-2", "")
    assert "Created model sim-embed-2 (task embed" in out
    run("change_model", "sim-embed-2", "--max-model-len", "2048", "--engine-model-id", "e2")
    model.refresh_from_db()
    assert (model.max_model_len, model.engine_model_id, model.task) == (2048, "e2", "embed")

    tenant = make_tenant("acme")
    out, _ = run("create_pool", "embed-pool", "--model", "sim-embed-2", "--max-sequences", "8",
                 "--set", "embedding_dim=128", "--set", "decode_tokens_per_s=500.5",
                 "--dedicated-to", "acme")
    pool = Pool.objects.get(name="embed-pool")
    assert (pool.model, pool.backend, pool.max_sequences, pool.dedicated_to, pool.enabled) == (
        model, Pool.Backend.SIMULATED, 8, tenant, True)
    assert pool.backend_settings == {"embedding_dim": 128, "decode_tokens_per_s": 500.5}
    assert "dedicated to acme" in out

    other = make_model("sim-other")
    run("change_pool", "embed-pool", "--model", "sim-other", "--shared", "--disable",
        "--unset", "decode_tokens_per_s", "--set", "embedding_dim=64")
    pool.refresh_from_db()
    assert (pool.model, pool.dedicated_to, pool.enabled) == (other, None, False)
    assert pool.backend_settings == {"embedding_dim": 64}
    run("change_pool", "embed-pool", "--enable", "--region", "eu-1")
    pool.refresh_from_db()
    assert (pool.enabled, pool.region, pool.max_sequences) == (True, "eu-1", 8)


@pytest.mark.parametrize(("args", "message"), [
    (["create_model", "sim-small"], "already exists"),
    (["create_model", "bad name"], "name:"),
    (["create_model", "m2", "--task", "dance"], "--task:"),
    (["create_model", "m2", "--max-model-len", "4"], "--max-model-len:"),
    (["change_model", "ghost", "--max-model-len", "99"], "no model named 'ghost'"),
    (["create_pool", "p2", "--model", "ghost"], "no model named 'ghost'"),
    (["create_pool", "p2", "--model", "sim-small", "--backend", "warp"], "--backend:"),
    (["create_pool", "p2", "--model", "sim-small", "--dedicated-to", "nobody"],
     "no tenant with slug 'nobody'"),
    (["create_pool", "p2", "--model", "sim-small", "--set", "warp_drive=9"], "warp_drive"),
    (["create_pool", "p2", "--model", "sim-small", "--set", "novalue"], "expected KEY=VALUE"),
    (["create_pool", "shared-one", "--model", "sim-small"], "already exists"),
    (["change_pool", "ghost", "--disable"], "no pool named 'ghost'"),
    (["change_pool", "shared-one", "--unset", "nothing"], "no such setting"),
    (["change_pool", "shared-one", "--max-sequences", "0"], "--max-sequences:"),
])
@pytest.mark.django_db
def test_model_and_pool_commands_refuse_bad_input(args, message):
    Pool.objects.create(name="shared-one", model=make_model("sim-small"))
    before = list(Pool.objects.values()), list(ServedModel.objects.values())
    with pytest.raises(CommandError, match=re.escape(message)):
        run(*args)
    assert (list(Pool.objects.values()), list(ServedModel.objects.values())) == before


# --- bootstrap_demo -----------------------------------------------------------------------------

@pytest.mark.django_db
def test_bootstrap_demo_is_idempotent_and_prints_secrets_once(settings):
    settings.GATEWAY_ADMIN_PASSWORD = ""
    first, _ = run("bootstrap_demo")
    password = re.search(r"password: (\S+)", first).group(1)
    plaintext = KEY_RE.search(first).group(0)
    assert get_user_model().objects.get(username="admin").check_password(password)
    principal = authenticate(bearer(plaintext))
    assert principal.tenant_slug == "demo"
    model = ServedModel.objects.get(name="sim-small")
    assert model.tokenizer_path == ""
    pool = Pool.objects.get(name="sim-local")
    assert (pool.backend, pool.model) == (Pool.Backend.SIMULATED, model)
    embed = Pool.objects.get(name="sim-embed-local")  # /v1/embeddings works at once
    assert (embed.backend, embed.model.name, embed.model.task) == (
        Pool.Backend.SIMULATED, "sim-embed", "embed")
    assert "/v1/embeddings" in first and '"model": "sim-embed"' in first
    assert Quota.objects.filter(tenant__slug="demo", model=None).count() == 1

    counts = [m.objects.count() for m in (Tier, ServedModel, Pool, Tenant, Quota, ApiKey)]
    assert "curl -N" in first and "from openai import OpenAI" in first
    second, _ = run("bootstrap_demo")
    assert "password" not in second and not KEY_RE.search(second)
    assert "issue_key demo" in second  # how to get another key, since it is shown only once
    assert counts == [m.objects.count() for m in (Tier, ServedModel, Pool, Tenant, Quota, ApiKey)]

    ApiKey.objects.filter(tenant__slug="demo").revoke()
    third, _ = run("bootstrap_demo")
    assert KEY_RE.search(third) and "password" not in third  # a usable key again


@pytest.mark.django_db
def test_bootstrap_demo_takes_the_admin_password_from_the_settings(settings):
    settings.GATEWAY_ADMIN_PASSWORD = "correct-horse-battery"
    out, _ = run("bootstrap_demo")
    assert "correct-horse-battery" not in out and "password" not in out
    assert get_user_model().objects.get(username="admin").check_password("correct-horse-battery")
    settings.GATEWAY_ADMIN_PASSWORD = "short"
    with pytest.raises(CommandError, match="GATEWAY_ADMIN_PASSWORD"):
        run("bootstrap_demo")


# --- through a real shell, as scripts use it -------------------------------------------------

@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_issue_key_from_the_shell_stdout_is_capturable():
    if connection.vendor != "postgresql":
        pytest.skip("the child process needs a shared database server")
    tenant = make_tenant("shell")
    db = connection.settings_dict
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "gateway.settings", "DATABASE_URL":
           f"postgres://{db['USER']}:{db['PASSWORD'] or ''}@{db['HOST']}:{db['PORT'] or 5432}/"
           f"{db['NAME']}"}
    done = subprocess.run([sys.executable, "manage.py", "issue_key", "shell"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert KEY_RE.fullmatch(done.stdout.strip())
    assert authenticate(bearer(done.stdout.strip())).tenant_id == tenant.pk
    bad = subprocess.run([sys.executable, "manage.py", "issue_key", "nobody"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and bad.stdout == "" and "nobody" in bad.stderr
