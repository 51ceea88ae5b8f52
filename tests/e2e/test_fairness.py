"""Fair sharing end to end.

Across shards: shards are released a few at a time, so a small job submitted just after
another tenant's many-shard job finishes long before it, in a time close to its time alone;
a ``high`` priority job overtakes a ``normal`` bulk job of the same tenant; and a ``low`` job
behind a ``normal`` bulk job of the same tenant is released after the aging bound, not after
the bulk job's last shard.

Inside one shard (the engine host's fair queue): a bulk job that is a single shard still
lets another tenant's small job, a ``high`` job of the same tenant, and (after the aging
bound) a ``low`` job through, instead of feeding the engine all of its requests first.
``python -m benchmarks.fairness`` measures the same scenarios at full size."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.engine_gate import ENV as GATE_ENV
from testkit.engine_gate import FileGate

pytestmark = [pytest.mark.services, pytest.mark.slow]

BIG, BIG_SHARD = 160, 16  # requests (10 shards of 16)
BIG_TOKENS = 128  # each (the big job holds the engine while the small one starts: _hold)
SMALL = 20
MAX_TOKENS = 8
# One shard (the stack's shard_max_requests is 16) of long requests: with 4 sequence slots it
# runs in 4 waves, and a small job that waited for the whole shard would finish after it.
SHARD, SHARD_TOKENS = 16, 512  # a bulk wave: 513 steps
AGING_S = 0.05  # short beside the bulk work in engine steps, however fast a step is


@pytest.fixture(scope="module", autouse=True)
def _release_settings(pg_url: str) -> Iterator[None]:
    """As many released shards as the model worker runs at once (2), and a quick sweep, in the
    stack this module starts. Batches that earlier tests of this session left running (their
    workers are gone) are ended first: they would hold this model's two release slots."""
    from sqlalchemy import create_engine, text

    engine = create_engine(pg_url)
    with engine.begin() as conn:
        stale = "SELECT id FROM batches WHERE status IN ('validating', 'in_progress', 'finalizing')"
        conn.execute(text(f"UPDATE shards SET status = 'closed' WHERE batch_id IN ({stale})"))
        conn.execute(text(f"UPDATE batches SET status = 'cancelled' WHERE id IN ({stale})"))
    engine.dispose()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHD_MAX_RELEASED_SHARDS_PER_MODEL", "2")
        mp.setenv("BATCHD_RELEASE_SWEEP_INTERVAL_S", "1")
        mp.setenv("BATCHD_LOW_PRIORITY_AGING_S", str(AGING_S))
        # A shard's first results are visible within 0.2 s, not at its end when it takes
        # under the default 5 s (the small job is created once the bulk shows results).
        mp.setenv("BATCHD_CHECKPOINT_INTERVAL_S", "0.2")
        yield


def _hold(stack) -> FileGate:
    """The big job holds the engine while the small one starts up (benchmarks.fairness)."""
    return FileGate(Path(stack.env[GATE_ENV]), "fairness")


@pytest.fixture(scope="module")
def bench():
    from benchmarks import fairness

    return fairness


@pytest.fixture(scope="module")
def clients(stack, bench):
    from openai import OpenAI

    url = stack.env["BATCHD_DATABASE_URL"]
    return {
        tenant: OpenAI(
            base_url=stack.base_url, api_key=bench.tenant_key(url, tenant), max_retries=0
        )
        for tenant in ("tenant-a", "tenant-b")
    }


@pytest.fixture(scope="module")
def small_alone(clients, bench) -> float:
    bench.alone(clients["tenant-b"], 4, 2, 60)  # warm-up
    return min(bench.alone(clients["tenant-b"], SMALL, MAX_TOKENS, 60).s for _ in range(2))


def test_small_job_is_not_stuck_behind_another_tenants_big_job(stack, clients, bench, small_alone):
    r = bench.contended(
        clients["tenant-a"],
        clients["tenant-b"],
        big=BIG,
        small=SMALL,
        max_tokens=BIG_TOKENS,
        small_max_tokens=MAX_TOKENS,
        timeout=180,
        finish_big=False,
        hold=_hold(stack),
    )
    print(f"small job alone {small_alone:.2f}s, behind the big job {r.small.s:.2f}s")
    assert r.small_done_first, r
    # Measured in the big job's progress, not in seconds (a step's time varies with the
    # machine's load; its order does not): the small job's shard waits for one of the big
    # job's two released shards to end, then shares the engine, and ends before the big job's
    # third shard does. Stuck behind the big job, it would end after most of its 160 requests.
    assert r.big_done_at_small_end <= 3 * BIG_SHARD, (r, small_alone)


def test_high_priority_overtakes_a_normal_bulk_job_of_the_same_tenant(
    stack, clients, bench, small_alone
):
    r = bench.contended(
        clients["tenant-a"],
        clients["tenant-a"],
        big=BIG,
        small=SMALL,
        max_tokens=BIG_TOKENS,
        small_max_tokens=MAX_TOKENS,
        timeout=180,
        small_extra={"priority": "high"},
        finish_big=False,
        hold=_hold(stack),
    )
    print(f"high job alone {small_alone:.2f}s, behind the bulk job {r.small.s:.2f}s")
    assert r.small_done_first, r
    assert r.big_done_at_small_end <= 3 * BIG_SHARD, (r, small_alone)  # as for another tenant


def test_low_priority_job_is_released_while_normal_shards_keep_the_slots_busy(
    stack, clients, bench
):
    """The bulk job's ten shards keep both release slots busy the whole time. Without aging at
    release the low job's first shard would go only once the bulk job's last shard had been
    released, i.e. with at least eight of its shards (128 requests) done; aged into normal
    after AGING_S, it takes a slot when the next one frees."""
    r = bench.contended(
        clients["tenant-a"],
        clients["tenant-a"],
        big=BIG,
        small=SMALL,
        max_tokens=BIG_TOKENS,
        small_max_tokens=MAX_TOKENS,
        timeout=180,
        small_extra={"priority": "low"},
        finish_big=False,
        hold=_hold(stack),
    )
    print(f"low job behind the bulk job {r.small.s:.2f}s, {r.big_done_at_small_end}/{BIG} "
          "bulk requests done when it completed")  # fmt: skip
    assert r.small_done_first, r
    assert r.big_done_at_small_end <= BIG - 3 * 16, r  # three bulk shards were still to finish


@pytest.fixture(scope="module")
def probe(stack, bench):
    """The model worker's engine counters (``engine_stats``)."""
    from testkit.service.stack import EngineStatsProbe

    probe = EngineStatsProbe(stack.env["BATCHD_BROKER_URL"], worker="model@e2e")
    yield probe
    probe.close()


def _behind_one_shard(stack, clients, bench, probe, small_client: str, **small_extra):
    """Tenant A's single-shard bulk job, then a small job once the bulk has finished its
    first requests; the bulk job is cancelled once the small one is done.

    Bounds are in engine steps: on a loaded machine seconds per step vary from one minute to
    the next, steps do not. A bulk request runs ``SHARD_TOKENS + 1`` steps (a wave: four run
    at once), and when the small job is created at least 12 bulk requests, three waves, are
    left: behind the shard's queue it would take three waves or more. Fairly admitted it
    waits for the running wave (nothing is preempted for normal work), then runs its own
    short requests; its start-up (validation, release, the shard thread reading its file)
    also counts in steps, since the engine keeps stepping meanwhile."""
    r = bench.contended(
        clients["tenant-a"],
        clients[small_client],
        big=SHARD,
        small=SMALL,
        max_tokens=SHARD_TOKENS,
        small_max_tokens=MAX_TOKENS,
        timeout=600,
        small_extra=small_extra or None,
        finish_big=False,
        hold=_hold(stack),
        probe=probe,
    )
    print(f"small job {r.small.s:.2f}s, {r.small.steps} engine steps; first bulk requests "
          f"done after {r.big_first_s:.2f}s; {r.big_done_at_small_end}/{SHARD} bulk requests "
          f"done when the small job completed")  # fmt: skip
    assert r.small_done_first, r
    assert r.big_done_at_small_end <= SHARD - 4, r  # at least one bulk wave was still to run
    assert r.small.steps is not None, "the model worker's engine_stats"
    return r


def test_small_job_overtakes_another_tenants_single_shard_bulk_job(stack, clients, bench, probe):
    r = _behind_one_shard(stack, clients, bench, probe, "tenant-b")
    assert r.small.steps < 3 * (SHARD_TOKENS + 1), r


def test_high_priority_overtakes_its_own_tenants_single_shard_bulk(stack, clients, bench, probe):
    """Tiers are strict: bulk sequences are suspended (or preempted, within the reserved
    room), so the high job starts at once and does not wait for the running bulk requests."""
    before = bench.engine_counters(probe)
    r = _behind_one_shard(stack, clients, bench, probe, "tenant-a", priority="high")
    after = bench.engine_counters(probe)

    def made_room(c: dict) -> int:
        return c["num_preemptions"] + c.get("num_suspended", 0)

    assert made_room(after) > made_room(before), (before, after)
    assert r.small.steps < 2 * (SHARD_TOKENS + 1), r


def test_low_priority_job_completes_while_normal_work_keeps_arriving(stack, clients, bench, probe):
    """Normal requests keep arriving from the bulk job's shard the whole time; without the
    aging bound the low job would wait for the last of them."""
    r = _behind_one_shard(stack, clients, bench, probe, "tenant-b", priority="low")
    assert r.small.steps < 3 * (SHARD_TOKENS + 1), r
