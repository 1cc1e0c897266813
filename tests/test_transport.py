"""Token transport on real Redis: per-step pipelined XADD, one multiplexed reader per process."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from infra.redis_conn import async_pool_for, get_async_redis, key
from serving import admission as acc
from serving import settlement, transport
from serving.keys import req_key, stream_key
from serving.transport import StepBatch
from tests.procs import arun

# Run on one Redis and again on a real Redis Cluster (tests/conftest.py redis_topology): every
# script's keys must stay in one slot.
pytestmark = pytest.mark.redis_topologies("single", "cluster")


async def _write_steps(rids: list[str], steps: int, *, pause: float = 0.0) -> None:
    """A worker's writer: one pipelined batch per step, then each request's final entry."""
    r = get_async_redis()
    for step in range(steps):
        batch = StepBatch(pool="p")
        for rid in rids:
            batch.add(rid, f"<{rid}:{step}>", 1, before=step, first=step == 0)
        await batch.flush(r, stream_ttl=120)
        if pause:
            await asyncio.sleep(pause)
    batch = StepBatch(pool="p")
    for rid in rids:
        event = transport.finish_event("stop", {"completion_tokens": steps})
        keys, args = settlement.settle_call("p", rid, status="ok", output_tokens=steps, event=event)
        batch.settle(rid, keys, args)
    await batch.flush(r, stream_ttl=120)


def _admit(rid: str) -> None:
    assert isinstance(arun(acc.admit_async(
        request_id=rid, tenant_id=1, key_id=1, pool="p", model="m", prompt_tokens=3,
        max_output_tokens=1000, stream=True,
        limits=acc.AdmissionLimits(tenant=acc.ScopeLimits()))), acc.Admitted)


def test_step_batch_writes_one_entry_per_request_and_counts_delivery(redis_client):
    _admit("a")
    _admit("b")

    async def main() -> list:
        batch = StepBatch(pool="p")
        batch.add("a", "Hel", 1, before=0, first=True)
        batch.add("b", "Hi", 1, before=0, first=True)
        batch.add("a", "lo", 1, before=1)  # two deltas of one request in one step: one entry
        keys, args = settlement.settle_call("p", "b", status="ok", output_tokens=1,
                                     event=transport.finish_event("stop", {"completion_tokens": 1}))
        batch.settle("b", keys, args)
        return await batch.flush(get_async_redis(), stream_ttl=120)

    [settled] = arun(main())
    assert settlement.parse_settle("b", settled) is not None
    entries = redis_client.xrange(stream_key("p", "a"))
    assert [e[1] for e in entries] == [{b"t": b"Hello", b"n": b"2"}]
    assert transport.delivered(redis_client, stream_key("p", "a")) == 2  # the entry's id says so
    assert entries[0][0] == b"2-1"
    assert redis_client.hget(req_key("p", "a"), "first_token_at") is not None
    assert 0 < redis_client.ttl(stream_key("p", "a")) <= 120
    # b: its tokens, then the final entry settle wrote in the same pipeline, after them.
    b = [e[1] for e in redis_client.xrange(stream_key("p", "b"))]
    assert b[0] == {b"t": b"Hi", b"n": b"1"} and b[1][b"f"] == b"stop"
    assert 0 < redis_client.ttl(stream_key("p", "b")) <= settlement.STREAM_TTL_AFTER_END


def test_one_reader_relays_many_requests_in_order(redis_client):
    rids = [f"r{i}" for i in range(200)]
    for rid in rids:
        _admit(rid)

    async def consume(rid: str) -> list[str]:
        return [e.fields.get("t", e.fields.get("f", ""))
                async for e in transport.subscribe("p", rid)]

    def relay_ids() -> set[str]:
        return {c["id"] for c in redis_client.client_list()
                if c.get("name") == transport.RELAY_CLIENT_NAME}

    before = relay_ids()

    async def main() -> list[list[str]]:
        readers = [asyncio.create_task(consume(rid)) for rid in rids]
        for _ in range(200):  # until the reader has connected (slower on a loaded machine)
            await asyncio.sleep(0.01)
            if transport.reader("p")._conn_id is not None:
                break
        writer = asyncio.create_task(_write_steps(rids, 20))
        opened = relay_ids() - before
        got = await asyncio.wait_for(asyncio.gather(*readers), 30)
        await writer
        assert len(opened) == 1, opened  # one multiplexed reader, not one per stream
        return got

    got = arun(main())
    for rid, texts in zip(rids, got, strict=True):
        assert texts == [f"<{rid}:{s}>" for s in range(20)] + ["stop"]


def test_resume_after_last_event_id_and_after_the_end(redis_client):
    _admit("r")
    arun(_write_steps(["r"], 5))
    ids = [e[0].decode() for e in redis_client.xrange(stream_key("p", "r"))]

    async def read(last: str) -> list[str]:
        return [e.id async for e in transport.subscribe("p", "r", last)]

    assert arun(read("0-0")) == ids  # a subscriber arriving after the end gets everything
    assert arun(read(ids[2])) == ids[3:]  # Last-Event-ID: resume just after it


async def reader_blocked(after_reads: int = -1, timeout: float = 5.0) -> None:
    """Wait until the shared reader's XREAD is blocked in Redis (CLIENT LIST flag ``b``), after
    more than ``after_reads`` completed reads: the state a test must reach before it interrupts
    the read, observed rather than guessed with a sleep."""
    reader, client = transport.reader("p"), get_async_redis()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn_id = reader._conn_id
        if reader.reads > after_reads and conn_id is not None:
            clients = await client.client_list()
            if any(c["id"] == str(conn_id) and "b" in c["flags"] for c in clients):
                return
        await asyncio.sleep(0.005)
    raise AssertionError("the stream reader never blocked in XREAD")


def test_new_subscription_interrupts_a_blocked_read(redis_client):
    """The reader blocks up to READ_BLOCK_MS; a new stream must not wait that long."""
    _admit("slow")
    _admit("late")

    async def main() -> float:
        idle = asyncio.create_task(anext(transport.subscribe("p", "slow")))
        await reader_blocked()  # the reader is now blocked on "slow" alone
        batch = StepBatch(pool="p")
        batch.add("late", "x", 1, before=0)
        await batch.flush(get_async_redis(), 60)
        start = time.monotonic()
        event = await anext(transport.subscribe("p", "late"))
        elapsed = time.monotonic() - start
        assert event.fields["t"] == "x"
        idle.cancel()
        return elapsed

    assert arun(main()) < transport.READ_BLOCK_MS / 1000 / 2


def test_relay_throughput_floor(redis_client):
    """Sanity floor, not a benchmark: 100 streams x 100 steps through one reader."""
    rids = [f"t{i}" for i in range(100)]
    for rid in rids:
        _admit(rid)

    async def consume(rid: str) -> int:
        return len([e async for e in transport.subscribe("p", rid)])

    async def main() -> float:
        readers = [asyncio.create_task(consume(rid)) for rid in rids]
        start = time.monotonic()
        await _write_steps(rids, 100)
        counts = await asyncio.wait_for(asyncio.gather(*readers), 60)
        assert counts == [101] * 100
        return 100 * 100 / (time.monotonic() - start)

    rate = arun(main())
    print(f"relayed {rate:,.0f} entries/s (writer and reader in one process)")
    assert rate > 3000


def test_cancel_is_published_on_the_pools_channel(redis_client):
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(transport.cancel_channel("p"))
    pubsub.get_message(timeout=1)
    assert transport.publish_cancel_sync("p", "req-1", "client_disconnect") == 1
    message = pubsub.get_message(timeout=2)
    assert message and message["data"] == b"req-1\tclient_disconnect"
    assert transport.cancel_channel("p") == key("cancel", "p")
    pubsub.close()


@pytest.mark.parametrize("fields", [{"e": "worker_lost", "m": "x", "r": "1"}, {"f": "stop"}])
def test_terminal_entries_end_the_iteration(fields):
    assert transport.StreamEvent("1-0", fields).terminal
    assert not transport.StreamEvent("1-0", {"t": "a", "n": "1"}).terminal


def test_a_burst_of_new_subscriptions_interrupts_the_read_once(redis_client):
    """1,000 streams opening in a burst must not re-send a growing XREAD once per stream."""
    rids = [f"burst{i}" for i in range(300)]
    for rid in rids:
        _admit(rid)

    async def main() -> tuple[int, list[int]]:
        idle = transport.open_subscription("p", "idle")
        await reader_blocked()  # the reader is blocked on one stream
        before = transport.reader("p").reads
        subs = [transport.open_subscription("p", rid) for rid in rids]  # no await in between
        await reader_blocked(after_reads=before)  # interrupted, and blocked again on them all
        reads = transport.reader("p").reads - before
        await _write_steps(rids, 3)
        got = [[(await s.next(10)).fields.get("t") for _ in range(3)] for s in subs]
        for s in [idle, *subs]:
            s.close()
        return reads, [len([t for t in g if t]) for g in got]

    reads, counts = arun(main())
    assert reads <= 3  # one interrupted read, then one with every stream in it
    assert counts == [3] * len(rids)


def test_next_before_returns_none_at_the_deadline_and_events_before_it(redis_client):
    _admit("dl")

    async def main() -> tuple[float, str | None, float, object]:
        sub = transport.open_subscription("p", "dl")
        start = time.monotonic()
        none = await sub.next_before(start + 0.2)
        waited = time.monotonic() - start
        batch = StepBatch(pool="p")
        batch.add("dl", "é\n\"x\"", 1, before=0)
        writer = asyncio.create_task(batch.flush(get_async_redis(), 60))
        event = await sub.next_before(time.monotonic() + 5)  # a new, later deadline
        await writer
        zero = await sub.next(0)  # nothing queued and no time left: at once
        sub.close()
        return waited, event.fields["t"] if event else None, time.monotonic() - start, (
            none, zero)

    waited, text, total, nones = arun(main())
    assert nones == (None, None)
    assert 0.18 <= waited < 1.0
    assert text == "é\n\"x\""  # the step script carries any text unchanged
    assert total < 3.0


def test_a_step_sent_twice_is_written_once(redis_client):
    """R1: a batch sent again after its reply was lost (the flush's retry) appends nothing
    twice and settles once; a step for a request whose state is gone writes nothing."""
    _admit("dup")

    def batch(before: int, text: str, *, settle: bool = False) -> StepBatch:
        b = StepBatch(pool="p")
        b.add("dup", text, 1, before=before, first=before == 0)
        if settle:
            keys, args = settlement.settle_call(
                "p", "dup", status="ok", output_tokens=2,
                event=transport.finish_event("stop", {"completion_tokens": 2}))
            b.settle("dup", keys, args)
        return b

    async def main() -> list[list]:
        r = get_async_redis()
        await batch(0, "a").flush(r, 120)
        await batch(0, "a").flush(r, 120)  # the same step again: its reply was lost
        first = await batch(1, "b", settle=True).flush(r, 120)
        again = await batch(1, "b", settle=True).flush(r, 120)
        await batch(5, "gone").flush(r, 120)  # not what this request has relayed
        return [first, again]

    first, again = arun(main())
    assert settlement.parse_settle("dup", first[0]) is not None
    assert settlement.parse_settle("dup", again[0]) is None  # settled once
    entries = [e[1] for e in redis_client.xrange(stream_key("p", "dup"))]
    assert [e.get(b"t") for e in entries] == [b"a", b"b", None]  # then the final entry
    assert entries[-1][b"f"] == b"stop"
    assert [e[0] for e in redis_client.xrange(stream_key("p", "dup"))][:2] == [b"1-1", b"2-2"]
    _admit("lost")
    redis_client.delete(req_key("p", "lost"))  # a Redis that came back empty

    async def lost() -> None:
        await batch_for("lost", 3).flush(get_async_redis(), 120)

    def batch_for(rid: str, before: int) -> StepBatch:
        b = StepBatch(pool="p")
        b.add(rid, "x", 1, before=before)
        return b

    arun(lost())
    assert not redis_client.exists(stream_key("p", "lost"), req_key("p", "lost"))


def test_a_batch_whose_connection_the_server_closed_is_sent_again(redis_client, monkeypatch):
    """The server closes the connection between checkout and the batch (a restart, a
    failover): the batch goes again on a fresh connection, tokens once, settled once."""
    _admit("cut")
    killed: list[int] = []

    async def main() -> list:
        client = get_async_redis()
        pool = await async_pool_for(client, stream_key("p", ""))  # the one flush uses
        real = pool.get_connection

        async def get_connection(*args, **kwargs):
            conn = await real(*args, **kwargs)
            if not killed:  # the first checkout only: its socket dies under the batch
                await conn.send_command("CLIENT", "ID")
                killed.append(await conn.read_response())
                node = redis.Redis(host=conn.host, port=conn.port)  # its node, cluster or not
                await asyncio.to_thread(node.client_kill_filter, _id=killed[0])
                node.close()
            return conn

        monkeypatch.setattr(pool, "get_connection", get_connection)
        batch = StepBatch(pool="p")
        batch.add("cut", "hello", 1, before=0, first=True)
        keys, args = settlement.settle_call(
            "p", "cut", status="ok", output_tokens=1,
            event=transport.finish_event("stop", {"completion_tokens": 1}))
        batch.settle("cut", keys, args)
        return await batch.flush(client, 120)

    [settled] = arun(main())
    assert killed and settlement.parse_settle("cut", settled) is not None
    entries = [e[1] for e in redis_client.xrange(stream_key("p", "cut"))]
    assert entries[0] == {b"t": b"hello", b"n": b"1"} and entries[1][b"f"] == b"stop"
    assert len(entries) == 2


def test_a_new_subscription_lets_a_read_that_returns_by_itself_take_it(redis_client,
                                                                        monkeypatch):
    """Under load the blocked read returns within a step anyway: a subscription opened
    during it waits for that (no CLIENT UNBLOCK) and still gets its entries; alone, it
    interrupts the read after UNBLOCK_AFTER_S (large here, so the timing holds)."""
    monkeypatch.setattr(transport, "UNBLOCK_AFTER_S", 0.3)
    monkeypatch.setattr(transport, "READ_BLOCK_MS", 5000)  # no read ends by its own timeout
    for rid in ("busy", "new1", "new2"):
        _admit(rid)

    async def main() -> tuple[int, str, int, str]:
        busy = transport.open_subscription("p", "busy")
        await reader_blocked()
        first = transport.open_subscription("p", "new1")
        step = StepBatch(pool="p")  # another stream's entry ends the read before the timer
        step.add("busy", "b", 1, before=0)
        await step.flush(get_async_redis(), 60)
        step = StepBatch(pool="p")
        step.add("new1", "x", 1, before=0)
        await step.flush(get_async_redis(), 60)
        got1 = (await first.next(5)).fields["t"]
        await asyncio.sleep(0.4)  # past the first timer: it found its read gone
        unblocks_busy = transport.reader("p").unblocks
        await reader_blocked()
        second = transport.open_subscription("p", "new2")  # nothing else will end the read
        step = StepBatch(pool="p")
        step.add("new2", "y", 1, before=0)
        await step.flush(get_async_redis(), 60)
        got2 = (await second.next(5)).fields["t"]
        unblocks_alone = transport.reader("p").unblocks - unblocks_busy
        for sub in (busy, first, second):
            sub.close()
        return unblocks_busy, got1, unblocks_alone, got2

    unblocks_busy, got1, unblocks_alone, got2 = arun(main())
    assert (unblocks_busy, got1) == (0, "x")
    assert (unblocks_alone, got2) == (1, "y")


def test_entry_ids_carry_the_delivered_count_and_a_zero_token_entry_keeps_them_rising(
        redis_client):
    """relay_step.lua D1: the id is <tokens so far>-<entry index>; an entry of no token (a
    frame of text only) still gets a higher id, and the count settle reads is the last one."""
    _admit("z")

    async def step(text: str, n: int, before: int, index: int) -> None:
        b = StepBatch(pool="p")
        b.add("z", text, n, before=before, first=index == 1, index=index)
        await b.flush(get_async_redis(), 120)

    async def main() -> None:
        await step("a", 2, 0, 1)
        await step("", 0, 2, 2)  # no token: same count, next index
        await step("b", 1, 2, 3)
        await step("b", 1, 2, 3)  # sent again after a lost reply: refused by its id

    arun(main())
    ids = [e[0] for e in redis_client.xrange(stream_key("p", "z"))]
    assert ids == [b"2-1", b"2-2", b"3-3"]
    assert transport.delivered(redis_client, stream_key("p", "z")) == 3
    keys, args = settlement.settle_call("p", "z", status="error", output_tokens=None)
    done = settlement.parse_settle("z", settlement.script("settle").run(redis_client, keys, args))
    assert done is not None and done.output_tokens == 3  # billed what the stream holds


def test_a_release_rides_in_a_later_step_batch_once(redis_client):
    """The worker's release.lua goes in the next batch's round trip; sent twice (a resent
    batch), the tenant is given back once."""
    _admit("rel")

    async def main() -> tuple[list, bool]:
        r = get_async_redis()
        b = StepBatch(pool="p")
        keys, args = settlement.settle_call("p", "rel", status="ok", output_tokens=0)
        b.settle("rel", keys, args)
        [reply] = await b.flush(r, 120)
        done = settlement.parse_settle("rel", reply)
        assert done is not None
        later = StepBatch(pool="p")
        later.release(done.release_keys, done.release_args)
        assert later  # a batch of releases alone is sent
        replies = await later.flush(r, 120)
        return replies, await settlement.release_async(done, r)

    replies, again = arun(main())
    assert replies == []  # no settle in it
    assert again is False  # the batch released it already: once


def test_a_request_whose_state_is_gone_ends_with_state_lost_and_only_it(redis_client):
    """After a reconnect (Redis restarted empty, or a failover lost writes) the relay asks, in
    one pipelined round trip, which of its open streams' requests still exist: only the one
    whose hash is gone ends, with the retryable ``state_lost``; the others keep waiting."""
    rids = ["kept1", "gone", "kept2"]
    for rid in rids:
        _admit(rid)

    async def main() -> tuple[list[str], list[bool]]:
        streams = {rid: transport.subscribe("p", rid) for rid in rids}
        firsts = {rid: asyncio.create_task(anext(s)) for rid, s in streams.items()}
        await reader_blocked()  # all three are subscribed
        assert redis_client.delete(req_key("p", "gone")) == 1
        relay = transport.reader("p")
        conn = await relay._connect()
        try:
            await relay._fail_lost(conn)
        finally:
            await conn.disconnect()
        event = await asyncio.wait_for(firsts["gone"], 5)
        await asyncio.sleep(0.2)  # time for a wrong end of the others to arrive
        pending = [not firsts[rid].done() for rid in ("kept1", "kept2")]
        for task in firsts.values():
            task.cancel()
        return [event.fields.get("e"), event.fields.get("r")], pending

    ended, pending = arun(main())
    assert ended == ["state_lost", "1"]
    assert pending == [True, True]
