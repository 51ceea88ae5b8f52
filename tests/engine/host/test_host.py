"""EngineHost: many producers, one engine loop thread, bounded queue, aborts, failures."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from core.llms.demo import build
from engine import LLM, Engine, RequestError, SamplingParams
from engine.core.step_cost import StepCostCurve
from engine.host.host import EngineHost, EngineStepError, HostError, HostQueueFull

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build("llama-tiny")


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _engine(model_dir: Path, **config) -> Engine:
    config.setdefault("max_num_seqs", 8)
    config.setdefault("num_kv_blocks", 128)
    return Engine(str(model_dir), **config)


def _loop_cpu_ticks(host: EngineHost) -> int:
    fields = Path(f"/proc/self/task/{host._thread.native_id}/stat").read_text().rsplit(")", 1)[1]
    utime, stime = fields.split()[11:13]
    return int(utime) + int(stime)


def _hold_when_full(engine: Engine, slots: int) -> threading.Event:
    """From the first step after which ``slots`` sequences run, hold ``engine`` (each step
    computes nothing) until the returned event is set: the test submits its newcomer while the
    engine is full, however fast the engine steps and however late the test's thread wakes.
    Held steps are not engine steps: ``num_steps`` counts only the real ones. The hold ends
    by itself after a minute, so that a test failing before it sets the event ends too."""
    release = threading.Event()
    step = engine.step
    full_at: float | None = None

    def held_step():
        nonlocal full_at
        if full_at is not None and not release.is_set():
            if time.monotonic() - full_at > 60:
                release.set()
            time.sleep(0.002)
            return []
        outputs = step()
        if full_at is None and len(engine.scheduler.running) >= slots:
            full_at = time.monotonic()
        return outputs

    engine.step = held_step
    return release


def test_many_producers_get_the_same_results_as_llm_generate(model_dir: Path) -> None:
    prompts = _prompts(24)
    expected = [
        o.outputs[0].token_ids
        for o in LLM(str(model_dir), max_num_seqs=8).generate(prompts, GREEDY, use_tqdm=False)
    ]

    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def producer(worker: int, host: EngineHost) -> None:
        try:
            futures = {
                i: host.submit(prompts[i], GREEDY, group=f"shard-{worker}")
                for i in range(worker, len(prompts), 4)
            }
            for i, fut in futures.items():
                results[i] = fut.result(timeout=60).outputs[0].token_ids
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    with EngineHost(_engine(model_dir), max_pending=3) as host:
        threads = [threading.Thread(target=producer, args=(w, host)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = host.stats()
    assert not errors
    assert [results[i] for i in range(len(prompts))] == expected
    assert stats.completed == len(prompts) and stats.pending == 0 and stats.in_flight == 0
    assert stats.submitted == len(prompts) and stats.failed == stats.aborted == 0
    assert 0.0 < stats.mean_occupancy <= 1.0
    assert stats.engine.kv_blocks_used == 0
    assert not host.is_alive


def test_bounded_queue_blocks_producers_until_the_loop_drains(model_dir: Path) -> None:
    host = EngineHost(_engine(model_dir), max_pending=2)  # not started: nothing drains yet
    prompts = _prompts(3, seed=1)
    first = [host.submit(p, GREEDY) for p in prompts[:2]]
    with pytest.raises(HostQueueFull, match="2 pending"):
        host.submit(prompts[2], GREEDY, timeout=0.05)

    submitted = threading.Event()
    box = {}

    def producer() -> None:
        box["future"] = host.submit(prompts[2], GREEDY)
        submitted.set()

    thread = threading.Thread(target=producer)
    thread.start()
    assert not submitted.wait(0.3), "submit returned while the queue was full"
    assert host.stats().pending == 2
    host.start()
    assert submitted.wait(30), "submit stayed blocked after the loop started draining"
    thread.join(5)
    for fut in [*first, box["future"]]:
        assert fut.result(timeout=60).outputs[0].finish_reason == "length"
    host.shutdown()


def test_abort_group_frees_blocks_and_leaves_other_groups_running(model_dir: Path) -> None:
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with EngineHost(_engine(model_dir, max_num_seqs=4), max_pending=16, group_window=16) as host:
        doomed = [host.submit(p, long, group="cancel-me") for p in _prompts(10, seed=2)]
        kept = [host.submit(p, short, group="keep") for p in _prompts(4, seed=3)]
        deadline = time.monotonic() + 30
        while host.stats().engine.kv_blocks_used == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # let some of the doomed group start decoding
        assert host.abort_group("cancel-me") == 10
        assert host.abort_group("cancel-me") == 0
        outs = [f.result(timeout=30) for f in doomed]
        assert all(o.outputs[0].finish_reason == "abort" for o in outs)
        assert any(o.outputs[0].token_ids for o in outs), "no doomed request was in flight"
        assert all(len(o.outputs[0].token_ids) < 400 for o in outs)
        kept_outs = [f.result(timeout=60) for f in kept]
        assert [o.outputs[0].finish_reason for o in kept_outs] == ["length"] * 4
        assert all(len(o.outputs[0].token_ids) == 12 for o in kept_outs)
        stats = host.stats()
        assert stats.engine.kv_blocks_used == 0
        assert stats.aborted == 10 and stats.completed == 4 and stats.in_flight == 0


def test_abort_one_request_and_unknown_ids(model_dir: Path) -> None:
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    with EngineHost(_engine(model_dir)) as host:
        fut = host.submit(_prompts(1)[0], long, request_id="r-1")
        with pytest.raises(ValueError, match="already pending or in flight"):
            host.submit([5, 6, 7], GREEDY, request_id="r-1")
        assert host.abort("r-1")
        assert fut.result(timeout=30).outputs[0].finish_reason == "abort"
        assert not host.abort("r-1")
        assert not host.abort("never-seen")


def test_request_error_lands_on_its_own_future(model_dir: Path) -> None:
    with EngineHost(_engine(model_dir, max_model_len=64)) as host:
        good = host.submit(_prompts(1)[0], GREEDY)
        bad = host.submit(list(range(3, 103)), GREEDY)  # 100 tokens > max_model_len
        also_good = host.submit(_prompts(1, seed=5)[0], GREEDY)
        assert isinstance(bad.exception(timeout=30), RequestError)
        assert good.result(timeout=30).outputs[0].finish_reason == "length"
        assert also_good.result(timeout=30).outputs[0].finish_reason == "length"
        assert host.stats().failed == 1


def test_step_failure_fails_in_flight_requests_and_the_host_keeps_serving(model_dir: Path) -> None:
    engine = _engine(model_dir)
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fell over")
        return real_step()

    engine.step = flaky_step
    with EngineHost(engine) as host:
        futures = [host.submit(p, GREEDY) for p in _prompts(3, seed=6)]
        for fut in futures:
            exc = fut.exception(timeout=30)
            assert isinstance(exc, EngineStepError)
            assert "device fell over" in str(exc.__cause__)
        after = host.submit(_prompts(1, seed=7)[0], GREEDY)
        assert after.result(timeout=30).outputs[0].finish_reason == "length"
        stats = host.stats()
        assert stats.step_errors == 1 and stats.failed == 3
        assert stats.engine.kv_blocks_used == 0


def test_idle_loop_sleeps_and_callbacks_fire(model_dir: Path) -> None:
    seen = []
    with EngineHost(_engine(model_dir)) as host:

        def callback(fut) -> None:  # runs on the loop thread: stats() must not wait for itself
            seen.append((fut, host.stats().completed))

        host.submit(_prompts(1)[0], GREEDY, callback=callback).result(timeout=30)
        time.sleep(0.1)
        steps, ticks = host.stats().steps, _loop_cpu_ticks(host)
        time.sleep(0.5)
        assert host.stats().steps == steps
        assert _loop_cpu_ticks(host) - ticks <= 3, "the idle loop is spinning"
    assert len(seen) == 1 and seen[0][0].done() and seen[0][1] == 1


def test_shutdown_drains_or_aborts_and_joins(model_dir: Path) -> None:
    host = EngineHost(_engine(model_dir)).start()
    drained = [host.submit(p, GREEDY) for p in _prompts(4, seed=8)]
    host.shutdown(wait=True)
    assert not host.is_alive
    assert all(f.result(timeout=0).outputs[0].finish_reason == "length" for f in drained)
    with pytest.raises(HostError, match="shut down"):
        host.submit([1, 2, 3], GREEDY)

    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    host = EngineHost(_engine(model_dir, max_num_seqs=2), engine_backlog=0).start()
    futures = [host.submit(p, long) for p in _prompts(6, seed=9)]
    host.shutdown(wait=True, abort_pending=True)
    assert not host.is_alive
    assert all(f.result(timeout=0).outputs[0].finish_reason == "abort" for f in futures)
    assert host.stats().engine.kv_blocks_used == 0


def test_priority_orders_the_host_queue_and_the_engine(model_dir: Path) -> None:
    """Submitted before the loop starts, with one sequence slot: the urgent request finishes
    first, then normal ones in arrival order, then the low-priority bulk."""
    host = EngineHost(_engine(model_dir, max_num_seqs=1), max_pending=8)
    prompts = _prompts(5, seed=7)
    order: list[str] = []
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    names_priorities = [
        ("low-a", 1),
        ("normal-a", 0),
        ("low-b", 1),
        ("urgent", -1),
        ("normal-b", 0),
    ]
    futures = [
        host.submit(p, params, request_id=name, priority=priority,
                    callback=lambda f: order.append(f.result().request_id))
        for p, (name, priority) in zip(prompts, names_priorities, strict=True)
    ]  # fmt: skip
    host.start()
    for fut in futures:
        fut.result(timeout=60)
    host.shutdown()
    assert order == ["urgent", "normal-a", "normal-b", "low-a", "low-b"]


def _completion_order(host: EngineHost, submissions: list[tuple[str, dict]]) -> list[str]:
    """Submit everything before the loop starts, run, and return request ids in the order
    they finished (with one sequence slot, the order the host admitted them)."""
    order: list[str] = []
    prompt = [5, 6, 7, 8, 9]
    futures = [
        host.submit(prompt, SamplingParams(max_tokens=kw.pop("max_tokens"), temperature=0.0,
                                           ignore_eos=True),
                    request_id=name, callback=lambda f: order.append(f.result().request_id), **kw)
        for name, kw in submissions
    ]  # fmt: skip
    host.start()
    for fut in futures:
        fut.result(timeout=60)
    host.shutdown()
    return order


def test_admission_order_across_tiers_tenants_batches_and_lengths(model_dir: Path) -> None:
    """Costs are 5 prompt tokens + max_tokens. Urgent first; in the normal tier tenants A and
    B share by tokens (the one charged fewer goes next), A's two batches share A's turns the
    same way, each batch runs its longest request first; low last."""
    host = EngineHost(_engine(model_dir, max_num_seqs=1), max_pending=16, group_window=16)
    a1 = [("a1-cost7", 2), ("a1-cost11", 6), ("a1-cost9", 4)]
    submissions = [
        *[(name, {"max_tokens": m, "tenant": "A", "group": "a1"}) for name, m in a1],
        ("a2-cost8", {"max_tokens": 3, "tenant": "A", "group": "a2"}),
        ("b1-first", {"max_tokens": 2, "tenant": "B", "group": "b1"}),
        ("b1-second", {"max_tokens": 2, "tenant": "B", "group": "b1"}),
        ("d1-low", {"max_tokens": 2, "tenant": "D", "group": "d1", "priority": 1}),
        ("c1-urgent", {"max_tokens": 2, "tenant": "C", "group": "c1", "priority": -1}),
    ]
    assert _completion_order(host, submissions) == [
        "c1-urgent",
        "a1-cost11",  # A and B at 0, A arrived first: a1's longest (A: 11)
        "b1-first",  # B: 7
        "b1-second",  # B (7) is still below A (11): 14
        "a2-cost8",  # A (11): a2 was charged nothing yet, a1 11
        "a1-cost9",
        "a1-cost7",
        "d1-low",
    ]


def test_a_new_batch_is_served_next_not_behind_the_queue(model_dir: Path) -> None:
    """A bulk batch fills the host's queue; a small batch of another tenant arriving later
    alternates with it instead of waiting for the bulk batch's queue to drain.

    The engine is held from its first finished request until the small batch is queued, so
    the positions do not depend on how many bulk requests a fast machine finishes meanwhile."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    order: list[str] = []
    queued = threading.Event()
    engine = _engine(model_dir, max_num_seqs=1)
    step = engine.step

    def held_step():
        if order and not queued.is_set():
            time.sleep(0.005)
            return []
        return step()

    def done(f) -> None:
        order.append(f.result().request_id)

    engine.step = held_step
    with EngineHost(engine, max_pending=80, group_window=40) as host:
        bulk = [host.submit([5, 6, 7], params, request_id=f"bulk-{i}", group="bulk",
                            tenant="A", callback=done) for i in range(40)]  # fmt: skip
        while not order:
            time.sleep(0.005)
        finished_before = len(order)  # the engine is held: no more finish until released
        small = [host.submit([5, 6, 7], params, request_id=f"small-{i}", group="small",
                             tenant="B", callback=done) for i in range(3)]  # fmt: skip
        queued.set()
        for fut in bulk + small:
            fut.result(timeout=60)
    last_small = max(order.index(f"small-{i}") for i in range(3))
    first_small = min(order.index(f"small-{i}") for i in range(3))
    # Only what was in the engine when the small batch arrived (max_num_seqs 1, no backlog:
    # one request) finishes before it; then turns alternate: three small requests take at
    # most six admissions.
    assert first_small - finished_before <= host.max_in_flight, order
    assert last_small - first_small <= 5, order


def test_feeding_window_bounds_each_batch_and_lets_a_newcomer_in(model_dir: Path) -> None:
    host = EngineHost(_engine(model_dir, max_num_seqs=2), max_pending=6, group_window=3)
    prompt = [5, 6, 7]
    for _ in range(3):
        host.submit(prompt, GREEDY, group="bulk")
    with pytest.raises(HostQueueFull, match="3 pending requests of group 'bulk' \\(limit 3"):
        host.submit(prompt, GREEDY, group="bulk", timeout=0.05)
    # A batch with nothing pending always gets in; then each holds an even share of
    # max_pending (6 // 2 = 3), within its window.
    host.submit(prompt, GREEDY, group="small")
    host.submit(prompt, GREEDY, group="small")
    host.submit(prompt, GREEDY, group="small")
    with pytest.raises(HostQueueFull, match="of group 'small'"):
        host.submit(prompt, GREEDY, group="small", timeout=0.05)
    # Three batches: the share is 6 // 3 = 2 (the first two now hold more than theirs).
    host.submit(prompt, GREEDY, group="third")
    host.submit(prompt, GREEDY, group="third")
    with pytest.raises(HostQueueFull, match="2 pending requests of group 'third' \\(limit 2"):
        host.submit(prompt, GREEDY, group="third", timeout=0.05)
    with pytest.raises(HostQueueFull, match="of group 'bulk' \\(limit 2"):
        host.submit(prompt, GREEDY, group="bulk", timeout=0.05)
    assert host.stats().pending == 8
    # Running: the queue drains into the engine, never more in flight than max_num_seqs.
    in_flight: list[int] = []
    host.start()
    deadline = time.monotonic() + 60
    while (stats := host.stats()).completed < 8 and time.monotonic() < deadline:
        in_flight.append(stats.in_flight)
    host.shutdown()
    assert host.stats().completed == 8
    assert max(in_flight) <= 2


def test_a_starved_low_batch_is_promoted_after_the_aging_bound(model_dir: Path) -> None:
    """Normal work keeps arriving; the low batch still runs, soon after its aging bound."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    stop = threading.Event()
    normal_done = []

    def feed(host: EngineHost) -> None:
        while not stop.is_set():
            host.submit([5, 6, 7], params, group="normal", tenant="A", timeout=1.0,
                        callback=normal_done.append)  # fmt: skip

    with EngineHost(_engine(model_dir, max_num_seqs=1), group_window=4, aging_s=0.3) as host:
        producer = threading.Thread(target=feed, args=(host,))
        producer.start()
        try:
            while len(normal_done) < 2:
                time.sleep(0.005)
            started = time.monotonic()
            low = host.submit([5, 6, 7], params, group="low", tenant="B", priority=1)
            low.result(timeout=60)
            waited = time.monotonic() - started
            ran_before = len(normal_done)
        finally:
            stop.set()
            producer.join()
    assert ran_before > 2, "normal work did not keep the engine busy"
    assert waited < 30, waited


def test_reserved_room_lets_urgent_work_start_while_bulk_fills_the_engine(model_dir: Path) -> None:
    """Bulk fills every slot (the reservation is lent while no urgent work waits); an
    urgent request preempts one bulk sequence and finishes long before the bulk does, and
    the preempted bulk sequence still yields exactly its greedy output."""
    bulk_params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    urgent_params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = _prompts(4, seed=11)
    expected = [o.outputs[0].token_ids for o in LLM(str(model_dir), max_num_seqs=4).generate(
        prompts, bulk_params, use_tqdm=False)]  # fmt: skip
    # fair_share off: the engine's own reservation makes the room (with it on, the host
    # suspends a bulk request instead; see the test below)
    engine = _engine(model_dir, max_num_seqs=4)
    full = _hold_when_full(engine, 4)
    host = EngineHost(engine, reserved_share=0.25, fair_share=False)
    with host:
        bulk = [host.submit(p, bulk_params, group="bulk") for p in prompts]
        bulk_done_at = _steps_each_done(host, bulk)
        deadline = time.monotonic() + 60
        seen = host.stats()
        while seen.engine.num_running < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
            seen = host.stats()
        assert seen.engine.num_running == 4  # all slots, the reserved one included
        urgent = host.submit([5, 6, 7], urgent_params, group="urgent", priority=-1)
        urgent_done_at = _steps_when_done(host, [urgent])
        full.set()
        urgent.result(timeout=60)
        urgent_done = urgent_done_at()
        outputs = [f.result(timeout=120).outputs[0].token_ids for f in bulk]
        stats = host.stats()
    assert max(bulk_done_at) > urgent_done, (bulk_done_at, urgent_done)
    assert stats.engine.num_preemptions >= 1
    assert outputs == expected


def _steps_each_done(host: EngineHost, futures: list) -> list[int]:
    """Call right after submitting ``futures``: the engine's step count when each resolves (in
    the order they resolve), read on the host's thread."""
    at: list[int] = []
    for f in futures:
        f.add_done_callback(lambda _f: at.append(host.stats().engine.num_steps))
    return at


def _steps_when_done(host: EngineHost, futures: list) -> Callable[[], int]:
    """Call right after submitting ``futures``; the returned function gives the engine's step
    count when the last of them resolved, read on the host's thread (it resolves futures
    between steps), not when the test's thread next runs: on a busy machine the host keeps
    stepping other requests meanwhile."""
    at: list[int] = []
    for f in futures:
        f.add_done_callback(lambda _f: at.append(host.stats().engine.num_steps))

    def last() -> int:
        deadline = time.monotonic() + 10
        while len(at) < len(futures) and time.monotonic() < deadline:
            time.sleep(0.005)  # a callback may still be running
        return max(at)

    return last


def test_a_new_tenant_gets_its_share_of_a_full_engine_at_once(model_dir: Path) -> None:
    """Tenant A's long requests hold every slot; tenant B's small batch arriving later does
    not wait for A's requests to finish: A's newest requests are suspended down to an equal
    share, B's run at once and finish long before A's, and every output (A's suspended ones
    included) is exactly its greedy output."""
    long = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    a_prompts, b_prompts = _prompts(8, seed=21), _prompts(3, seed=22)
    llm = LLM(str(model_dir), max_num_seqs=8)
    want_a = [o.outputs[0].token_ids for o in llm.generate(a_prompts, long, use_tqdm=False)]
    want_b = [o.outputs[0].token_ids for o in llm.generate(b_prompts, short, use_tqdm=False)]
    engine = _engine(model_dir, max_num_seqs=4)
    full = _hold_when_full(engine, 4)
    with EngineHost(engine) as host:
        a = [host.submit(p, long, group="bulk", tenant="A") for p in a_prompts]
        a_done_at = _steps_each_done(host, a)
        deadline = time.monotonic() + 60
        while host.stats().engine.num_running < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        steps_before = host.stats().engine.num_steps
        b = [host.submit(p, short, group="small", tenant="B") for p in b_prompts]
        b_done_at = _steps_when_done(host, b)
        full.set()
        got_b = [f.result(timeout=60).outputs[0].token_ids for f in b]
        b_done = b_done_at()
        steps_for_b = b_done - steps_before
        got_a = [f.result(timeout=120).outputs[0].token_ids for f in a]
        stats = host.stats()
    # B ends while A still runs, in engine steps, not in the test thread's time (that thread
    # may sleep while the host steps on, so B may arrive after some of A's requests ended).
    assert max(a_done_at) > b_done, (a_done_at, b_done)
    # B's share is 2 of the 4 slots: its three 6-token requests run in two waves (about 14
    # steps), not after A's 120-token requests free their slots (over 100 steps).
    assert steps_for_b <= 24, steps_for_b
    assert stats.suspended >= 2 and stats.engine.num_suspended == stats.suspended
    assert got_a == want_a and got_b == want_b


def test_one_tenant_alone_keeps_every_slot(model_dir: Path) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    with EngineHost(_engine(model_dir, max_num_seqs=4)) as host:
        first = [host.submit(p, params, group="one", tenant="A") for p in _prompts(4, seed=3)]
        deadline = time.monotonic() + 60
        while host.stats().engine.num_running < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        more = [host.submit(p, params, group="two", tenant="A") for p in _prompts(4, seed=4)]
        for f in first + more:
            f.result(timeout=60)
        assert host.stats().suspended == 0


def test_urgent_work_beyond_the_reservation_suspends_bulk(model_dir: Path) -> None:
    """Three urgent requests, one reserved slot: the first takes the reservation, the other
    two suspend the newest bulk requests instead of waiting for them; all finish in about
    the steps their own tokens need, and the bulk's outputs are untouched."""
    long = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    bulk_prompts, urgent_prompts = _prompts(4, seed=31), _prompts(3, seed=32)
    llm = LLM(str(model_dir), max_num_seqs=8)
    want = [o.outputs[0].token_ids for o in llm.generate(bulk_prompts, long, use_tqdm=False)]
    engine = _engine(model_dir, max_num_seqs=4)
    full = _hold_when_full(engine, 4)
    with EngineHost(engine, reserved_share=0.25) as host:
        bulk = [host.submit(p, long, group="bulk", tenant="A") for p in bulk_prompts]
        bulk_done_at = _steps_each_done(host, bulk)
        deadline = time.monotonic() + 60
        while host.stats().engine.num_running < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        steps_before = host.stats().engine.num_steps
        urgent = [
            host.submit(p, short, group="now", tenant="A", priority=-1) for p in urgent_prompts
        ]
        urgent_done_at = _steps_when_done(host, urgent)
        full.set()
        for f in urgent:
            f.result(timeout=60)
        urgent_done = urgent_done_at()
        steps_for_urgent = urgent_done - steps_before
        got = [f.result(timeout=120).outputs[0].token_ids for f in bulk]
        stats = host.stats()
    assert max(bulk_done_at) > urgent_done, (bulk_done_at, urgent_done)
    assert steps_for_urgent <= 12, steps_for_urgent  # 20 without suspending (three waves)
    assert stats.suspended >= 1
    assert got == want


class _PlantedCurve(StepCostCurve):
    """A step-cost curve set by the test; the engine's own measurements leave it as it is."""

    def __init__(self, max_num_seqs: int, cost) -> None:
        super().__init__(max_num_seqs)
        for n in range(1, max_num_seqs + 1):
            super().observe(n, n, cost(n))

    def observe(self, num_seqs: int, num_tokens: int, seconds: float) -> None:
        pass


def _bulk_beside_urgent(model_dir: Path, cost) -> tuple[list[int], list[int], bool]:
    """Four long bulk requests fill a 4-slot engine, then two urgent ones arrive, under the
    urgent guard with the curve ``cost``: the bulk sequences running after each step that
    ran urgent ones, the bulk running after the others, and whether every output is its
    greedy output."""
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    bulk_prompts, urgent_prompts = _prompts(4, seed=41), _prompts(2, seed=42)
    llm = LLM(str(model_dir), max_num_seqs=8)
    want_bulk = [o.outputs[0].token_ids for o in llm.generate(bulk_prompts, long, use_tqdm=False)]
    want_urgent = [
        o.outputs[0].token_ids for o in llm.generate(urgent_prompts, short, use_tqdm=False)
    ]
    engine = _engine(model_dir, max_num_seqs=4)
    engine.step_cost = _PlantedCurve(4, cost)
    beside, other = [], []
    step = engine.step

    def recording_step():
        outputs = step()
        priorities = [seq.priority for seq in engine.scheduler.running]
        bulk = sum(p >= 0 for p in priorities)
        (beside if len(priorities) > bulk else other).append(bulk)
        return outputs

    engine.step = recording_step
    full = _hold_when_full(engine, 4)
    with EngineHost(engine, reserved_share=0.25, urgent_slowdown=1.5) as host:
        bulk = [host.submit(p, long, group="bulk", tenant="A") for p in bulk_prompts]
        deadline = time.monotonic() + 60
        while host.stats().engine.num_running < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        urgent = [
            host.submit(p, short, group="now", tenant="A", priority=-1) for p in urgent_prompts
        ]
        full.set()
        got_urgent = [f.result(timeout=60).outputs[0].token_ids for f in urgent]
        got_bulk = [f.result(timeout=120).outputs[0].token_ids for f in bulk]
    return beside, other, got_bulk == want_bulk and got_urgent == want_urgent


def test_bulk_beside_urgent_work_is_held_to_the_room_a_steep_step_cost_leaves(
    model_dir: Path,
) -> None:
    """A step costing 10 ms + 10 ms per sequence (a CPU's shape): two urgent sequences cost
    30 ms; within 1.5x of that (45 ms) one bulk sequence fits beside them, so the other bulk
    sequences are suspended while urgent work runs, come back after it, and every output is
    exactly greedy."""
    beside, other, exact = _bulk_beside_urgent(model_dir, lambda n: 0.010 + 0.010 * n)
    assert beside and max(beside) <= 1, beside
    assert max(other) == 4
    assert exact


def test_a_flat_step_cost_holds_no_bulk_back_beside_urgent_work(model_dir: Path) -> None:
    """An accelerator's shape: a step costs the same whatever its sequences, so bulk keeps
    every slot the urgent work leaves (2 of 4)."""
    beside, _other, exact = _bulk_beside_urgent(model_dir, lambda n: 0.010)
    assert beside and max(beside) == 2, beside
    assert exact


def test_a_new_tenant_gets_its_share_beside_n_completion_requests(model_dir: Path) -> None:
    """Tenant A's two n=64 requests are 128 completions, each holding a slot of its own (not
    one slot per request, with 126 forks queued ahead of everyone inside the engine): tenant
    B's small batch arriving behind them gets its share at once, as beside single
    completions, and every completion is exactly its greedy output."""
    wide = SamplingParams(n=64, max_tokens=12, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    a_prompts, b_prompts = _prompts(2, seed=51), _prompts(3, seed=52)
    llm = LLM(str(model_dir), max_num_seqs=8)
    single = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want_a = [o.outputs[0].token_ids for o in llm.generate(a_prompts, single, use_tqdm=False)]
    want_b = [o.outputs[0].token_ids for o in llm.generate(b_prompts, short, use_tqdm=False)]
    engine = _engine(model_dir, max_num_seqs=4)
    full = _hold_when_full(engine, 4)
    with EngineHost(engine) as host:
        a = [host.submit(p, wide, group="wide", tenant="A") for p in a_prompts]
        a_done_at = _steps_each_done(host, a)
        # One snapshot, read between two steps: a completion that ends in the next step leaves
        # a slot free until the turn after it, so two snapshots need not agree.
        deadline = time.monotonic() + 60
        seen = host.stats()
        while seen.engine.num_running < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
            seen = host.stats()
        assert (seen.engine.num_running, seen.in_flight) == (4, 4)  # four completions, four slots
        steps_before = host.stats().engine.num_steps
        b = [host.submit(p, short, group="small", tenant="B") for p in b_prompts]
        b_done_at = _steps_when_done(host, b)
        full.set()
        got_b = [f.result(timeout=60).outputs[0].token_ids for f in b]
        b_done = b_done_at()
        steps_for_b = b_done - steps_before
        outs_a = [f.result(timeout=300) for f in a]
        stats = host.stats()
    assert max(a_done_at) > b_done, (a_done_at, b_done)
    # As beside single requests (test_a_new_tenant_gets_its_share_of_a_full_engine_at_once):
    # B's share is 2 of the 4 slots, its three 6-token requests run in two waves (about 14
    # steps). Before n > 1 requests were split, B waited for A's 128 completions (~380 steps).
    # Its two slots come from suspending A's completions or from ones that end by themselves
    # between the snapshot above and B's arrival (a completion ends every ~3 steps here, and a
    # fast engine or a descheduled test thread runs several steps there): how many of each is
    # timing, not fairness, so only the steps B took are asserted.
    assert steps_for_b <= 24, steps_for_b
    assert got_b == want_b
    for out, want in zip(outs_a, want_a, strict=True):
        assert [c.index for c in out.outputs] == list(range(64))
        assert all(c.token_ids == want for c in out.outputs)
        assert all(c.finish_reason == "length" for c in out.outputs)
    assert stats.completed == 5 and stats.submitted == 5
    assert (stats.pending, stats.in_flight, stats.engine.kv_blocks_used) == (0, 0, 0)


def test_a_split_request_gives_the_engines_own_n_completions(model_dir: Path) -> None:
    """Completion i samples with seed + i, whether the engine forks the request or the host
    splits it; the prompt is counted once in the engine's statistics."""
    prompt = _prompts(1, seed=53, lo=40, hi=40)[0]
    params = SamplingParams(n=6, max_tokens=10, temperature=0.9, seed=17, ignore_eos=True)
    want = LLM(str(model_dir), max_num_seqs=8).generate([prompt], params, use_tqdm=False)[0]
    with EngineHost(_engine(model_dir, max_num_seqs=4)) as host:
        got = host.submit(prompt, params, request_id="six", tenant="A").result(timeout=60)
        stats = host.stats()
    assert got.request_id == "six" and got.prompt_token_ids == prompt
    assert [c.index for c in got.outputs] == list(range(6))
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert [c.text for c in got.outputs] == [c.text for c in want.outputs]
    assert len({tuple(c.token_ids) for c in got.outputs}) > 1
    assert stats.engine.total_prompt_tokens == len(prompt)
    assert stats.completed == 1 and stats.submitted == 1
    assert got.metrics.first_token_time is not None and got.metrics.finished_time is not None


def test_abort_cancel_and_refusal_of_a_split_request(model_dir: Path) -> None:
    """A split request is one request to its caller: ``abort`` with its id aborts every
    completion (its output carries n aborted ones), cancelling it while it is pending takes
    all of them out of the queue, a refusal fails it once, and each counts once."""
    long = SamplingParams(n=5, max_tokens=500, temperature=0.0, ignore_eos=True)
    host = EngineHost(_engine(model_dir, max_num_seqs=2, max_model_len=512), max_pending=16)
    cancelled = host.submit([5, 6, 7], long, request_id="cancel-me")
    assert cancelled.cancel()  # still pending: the caller may cancel it
    assert host.stats().pending == 0  # its completions left the queue
    running = host.submit([5, 6, 7, 8], long, request_id="running")
    for taken in ("running", "running#2"):
        with pytest.raises(ValueError, match="already pending or in flight"):
            host.submit([5, 6, 7], GREEDY, request_id=taken)
    with host:
        deadline = time.monotonic() + 60
        while host.stats().engine.num_running < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not host.abort("running#1")  # a completion is not a request of its own
        assert host.abort("running")
        out = running.result(timeout=30)
        assert [c.index for c in out.outputs] == list(range(5))
        assert all(c.finish_reason == "abort" for c in out.outputs)
        assert any(c.token_ids for c in out.outputs)  # those in flight had begun
        refused = host.submit(list(range(3, 603)), SamplingParams(n=3), request_id="too-long")
        assert isinstance(refused.exception(timeout=30), RequestError)
        after = host.submit([5, 6, 7], GREEDY).result(timeout=30)  # the host keeps serving
        assert after.outputs[0].finish_reason == "length"
        stats = host.stats()
    assert (stats.submitted, stats.completed, stats.aborted, stats.failed) == (4, 1, 1, 1)
    assert (stats.pending, stats.in_flight, stats.engine.kv_blocks_used) == (0, 0, 0)


def test_an_idle_engine_runs_its_lead_alone_then_fills(model_dir: Path) -> None:
    """Eight requests reach an idle engine with room for all: with ``lead_requests=2`` the
    first two run alone and finish about ten steps before the rest, which are admitted only
    then, all at once (the engine is empty then, but not idle: no new lead starts); with ``lead_steps=3`` the rest join after three steps and all finish within a few
    steps of each other. Greedy outputs are the same either way."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = _prompts(8, seed=31)
    llm = LLM(str(model_dir), max_num_seqs=8)
    want = sorted(o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False))

    def run(**lead) -> list[int]:
        host = EngineHost(_engine(model_dir), **lead)
        futures = [host.submit(p, params, group="batch") for p in prompts]  # all pending
        done_at = _steps_each_done(host, futures)
        with host.start():
            got = sorted(f.result(timeout=60).outputs[0].token_ids for f in futures)
        assert got == want
        return sorted(done_at)

    led = run(lead_requests=2)
    first, rest = led[:2], led[2:]
    assert max(first) <= 11 and min(rest) >= max(first) + 9, (first, rest)
    # The lead ended with the engine empty and work pending: the rest fill it in one wave,
    # they do not start another lead of two.
    assert rest[-1] - rest[0] <= 1, rest
    capped = run(lead_requests=2, lead_steps=3)
    assert capped[-1] - capped[0] <= 4 and capped[-1] <= 15, capped
    filled = run()  # no lead: one wave
    assert filled[-1] - filled[0] <= 1, filled
