"""Redis Cluster (ADR 0018): the setting, the clients, one slot per script, resharding.

The integration suite on a real three-primary cluster is not here: the modules that exercise
every script (accounting, WFQ, transport, janitor, and the live gateway and worker tests of
tests/test_inference_live.py) carry ``redis_topologies("single", "cluster")`` and run once on
each (tests/conftest.py ``redis_topology``). Redis Cluster refuses a script or a multi-key
command whose keys span slots (CROSSSLOT; redis-py refuses it before sending), so a key that
lost its hash tag fails those tests. ``test_every_script_call_stays_in_one_slot`` checks the
same thing on the key builders without a cluster, in milliseconds.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio.cluster as aiocluster
import redis.cluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from gateway.contentlog import store
from infra import redis_conn
from metering import keys as metering_keys
from serving import admission, cells, settlement, transport, wfq
from serving.keys import inflight_key, req_key, worker_key, workers_key
from tests.redis_cluster import RedisCluster, fresh_redis_clients
from workers import cell_quota

ROOT = Path(__file__).resolve().parent.parent


def _slot(*keys: str) -> set[int]:
    return {key_slot(k.encode()) for k in keys}


# -- settings and clients ---------------------------------------------------------------------


def _start(**env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "DJANGO_SETTINGS_MODULE": "gateway.settings", **env}
    return subprocess.run([sys.executable, "-c", "import django; django.setup()"], cwd=ROOT,
                          env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("value", ["no-port", "h:0", "h:99999", "a:1,:2"])
@pytest.mark.integration
def test_bad_cluster_address_names_the_setting(value: str) -> None:
    done = _start(REDIS_CLUSTER_NODES=value)
    assert done.returncode != 0
    assert "REDIS_CLUSTER_NODES" in done.stderr.strip().splitlines()[-1], done.stderr[-500:]


@pytest.mark.integration
def test_cluster_and_sentinels_together_stop_startup() -> None:
    done = _start(REDIS_CLUSTER_NODES="127.0.0.1:7000", REDIS_SENTINELS="127.0.0.1:26379",
                  REDIS_SENTINEL_MASTER="m")
    assert done.returncode != 0 and "not both" in done.stderr


@pytest.fixture
def cluster(redis_cluster: RedisCluster) -> RedisCluster:
    return redis_cluster


@pytest.fixture
def fresh_clients() -> Iterator[None]:
    fresh_redis_clients()
    yield
    fresh_redis_clients()


@pytest.mark.integration
def test_cluster_clients_find_every_node_from_one(fresh_clients: None, settings: Any,
                                                   cluster: RedisCluster) -> None:
    settings.REDIS_CLUSTER_NODES = [("127.0.0.1", cluster.ports[0])]
    settings.REDIS_URL = ""
    sync: Any = redis_conn.get_redis()
    assert isinstance(sync, redis.cluster.RedisCluster)
    assert {n.port for n in sync.get_primaries()} == set(cluster.ports)  # learnt the others
    async_client = redis_conn.new_async_redis()
    assert isinstance(async_client, aiocluster.RedisCluster)
    # A script runs on the node that owns its first key's slot.
    k = redis_conn.pool_key("x", "chat")
    assert sync.eval("redis.call('SET', KEYS[1], 'v') return 1", 1, k) == 1
    assert redis.Redis(port=cluster.owner(k)).get(k) == b"v"
    sync.delete(k)
    redis_conn.redis_url.cache_clear()
    with pytest.raises(RuntimeError, match="CELERY_BROKER_URL"):
        redis_conn.redis_url()
    redis_conn.redis_url.cache_clear()


# -- one slot per script ----------------------------------------------------------------------


def test_every_script_call_stays_in_one_slot(settings: Any) -> None:
    """The keys each script and multi-key command is called with, as the code builds them,
    hash to one slot: the tenant's for admission and release, the pool's for the rest."""
    settings.REDIS_KEY_PREFIX = "igw"
    limits = admission.AdmissionLimits(tenant=admission.ScopeLimits(input_tpm=10),
                                       key=admission.ScopeLimits(output_tpm=5))
    calls = admission._admit_call(
        request_id="r1", tenant_id=42, key_id=7, pool="chat", model="m", prompt_tokens=3,
        max_output_tokens=4, stream=True, limits=limits, now=None, extra=None)
    tenant_slot = _slot(*calls.charge_keys)
    pool_slot = _slot(*calls.enter_keys)
    assert len(tenant_slot) == 1 and len(pool_slot) == 1
    assert tenant_slot != pool_slot  # the split is real: they would be CROSSSLOT together
    assert _slot(*admission._unwind_args(calls)[0]) == tenant_slot

    keys, _ = settlement.settle_call("chat", "r1", status="ok", inflight=inflight_key("chat", "w"))
    assert _slot(*keys, inflight_key("chat", "w")) == pool_slot
    # release.lua's keys come back from settle.lua: the req hash stores them at enter.
    fields = dict(zip(calls.enter_args[10::2], calls.enter_args[11::2], strict=True))
    release_keys = [fields["tk"], fields["tw"], *(fields[f"b{i}"] for i in range(1, 5))]
    assert _slot(*release_keys) == tenant_slot

    w = wfq._keys("chat")
    assert _slot(*w.common, w.queue("42"), inflight_key("chat", "w"), w.qprefix) == pool_slot
    assert _slot(workers_key("chat"), worker_key("chat", "w", "reaped"),
                 worker_key("chat", "w", "load"), inflight_key("chat", "w")) == pool_slot
    assert _slot(transport.wake_key("chat"), w.qprefix) == pool_slot
    # dispatch.lua claims req:{pool}:rid by prefix (undeclared, on the declared keys' slot)
    assert _slot(req_key("chat", ""), req_key("chat", "zz"), *w.common) == pool_slot
    assert _slot(req_key("chat", "a"), transport.stream_key("chat", "a"),
                 req_key("chat", "b"), transport.stream_key("chat", "b")) == pool_slot
    assert _slot(metering_keys.pending_key("chat"), metering_keys.processing_key("chat"),
                 metering_keys.lease_key("chat"), req_key("chat", "r1")) == pool_slot
    assert len(_slot(store.pending_key(), store.processing_key(), store.lease_key(),
                     store.stats_key())) == 1


@pytest.mark.integration
def test_a_cross_slot_script_is_refused_by_the_cluster(cluster: RedisCluster) -> None:
    """What the tags prevent: the cluster (here redis-py before it) refuses a script whose
    keys span slots, which is how the cluster runs of the modules catch a key that lost its tag."""
    client = cluster.client()
    with pytest.raises(RedisClusterException, match="same key slot"):
        client.eval("return 1", 2, redis_conn.tenant_key("a", 1), redis_conn.pool_key("a", "p"))
    assert client.eval("return 1", 2, redis_conn.pool_key("a", "p"),
                       redis_conn.pool_key("b", "p", "x")) == 1


@pytest.mark.integration
def test_a_cell_on_a_cluster_takes_its_quota_share(cluster: RedisCluster) -> None:
    """The rebalancer reaches a cell that runs Redis Cluster (redis+cluster://): its share
    script lands on the tenant's slot, on whichever primary owns it."""
    client = cell_quota.cell_client(f"redis+cluster://127.0.0.1:{cluster.ports[0]}")
    assert isinstance(client, redis.cluster.RedisCluster)
    base = cells.Share(1_000, 2_000, 600, 600)
    step = cells.set_cell(client, "77", base, cells.Share(9_000, 9_000, 900, 900),
                          cells.Share(1e9, 1e9, 1e9, 1e9))
    assert step.after == cells.Share(9_000, 9_000, 900, 900)
    assert cells.read_cell(client, "77", base).before == step.after


# -- resharding -------------------------------------------------------------------------------


def _move_slot(cluster: RedisCluster, slot: int, src: int, dst: int) -> int:
    """Migrate one slot from node ``src`` to node ``dst`` (ports) as ``redis-cli --cluster
    reshard`` does; returns how many keys moved."""
    a, b = redis.Redis(port=src), redis.Redis(port=dst)
    src_id, dst_id = a.execute_command("CLUSTER MYID"), b.execute_command("CLUSTER MYID")
    b.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
    a.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
    moved = 0
    while keys := a.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
        a.execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *keys)
        moved += len(keys)
    for port in cluster.ports:
        redis.Redis(port=port).execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    return moved


@pytest.mark.integration
def test_a_reshard_of_a_pools_slot_moves_its_streams_and_settles_once(
        fresh_clients: None, settings: Any, cluster: RedisCluster) -> None:
    """The pool's slot moves to another primary while a request streams. The gateway's reader
    follows the slot to its new owner and loses no entry; the worker's step that met the move
    fails as a lost connection (and is retried there); settlement still happens once."""
    from tests.procs import arun

    settings.REDIS_CLUSTER_NODES = [("127.0.0.1", cluster.ports[0])]
    settings.REDIS_KEY_PREFIX = "mv"
    pool, rid = "mv-pool", "mv-1"
    r: Any = redis_conn.get_redis()
    r.flushdb()
    assert isinstance(arun(admission.admit_async(
        request_id=rid, tenant_id=5, key_id=5, pool=pool, model="m", prompt_tokens=3,
        max_output_tokens=100, stream=True,
        limits=admission.AdmissionLimits(tenant=admission.ScopeLimits(concurrent_requests=1)))),
        admission.Admitted)
    slot = key_slot(req_key(pool, rid).encode())
    src = cluster.owner(req_key(pool, rid))
    dst = next(p for p in cluster.ports if p != src)

    async def step(text: str, before: int) -> None:
        batch = transport.StepBatch(pool=pool)
        batch.add(rid, text, 1, before=before)
        for attempt in range(3):
            try:
                await batch.flush(redis_conn.get_async_redis(), stream_ttl=60)
                return
            except redis.ConnectionError:  # the slot moved under this step: as a lost write
                assert attempt < 2

    async def main() -> tuple[list[str], int]:
        sub = transport.open_subscription(pool, rid)
        await step("a", 0)
        first = await sub.next(10)
        moved = await asyncio.to_thread(_move_slot, cluster, slot, src, dst)
        await step("b", 1)
        assert await settlement.settle_async(pool, rid, status="ok", output_tokens=2,
                                             event=transport.finish_event("stop", {}))
        texts = [first.fields["t"] if first else ""]
        while (event := await sub.next(10)) is not None:
            texts.append(event.fields.get("t", event.fields.get("f", "")))
            if event.terminal:
                break
        sub.close()
        assert not await settlement.settle_async(pool, rid, status="ok", output_tokens=2)
        return texts, moved

    texts, moved = arun(main())
    assert moved >= 2  # the request hash and its stream (and the deadlines zset) moved
    assert cluster.owner(req_key(pool, rid)) == dst
    assert texts == ["a", "b", "stop"]
    assert len(r.lrange(metering_keys.pending_key(pool), 0, -1)) == 1  # settled once
    assert int(r.get(admission.counter_key("conc", 5)) or 0) == 0  # released on the tenant slot
    r.flushdb()
