"""benchmarks.busy (the engine beside a background load) and the peer benchmark's workloads."""

from __future__ import annotations

import os

from benchmarks import busy, peer


def test_busy_reports_a_share_and_stops_its_load() -> None:
    from core.llms.demo import build

    model = build("llama-tiny")
    report = busy.main(
        ["--model", str(model), "--rounds", "1", "--num-requests", "3", "--output-len", "3"]
    )
    assert report["share"] == report["busy_tok_s"] / report["quiet_tok_s"] > 0
    assert [len(report["runs"][m]) for m in ("quiet", "busy")] == [1, 1]
    for run in report["runs"]["busy"] + report["runs"]["quiet"]:
        assert run["user_s"] >= 0 and run["sys_s"] >= 0 and run["threads_at_end"] >= 1


def test_background_load_is_two_niced_processes_gone_on_exit() -> None:
    with busy.BackgroundLoad() as load:
        procs = list(load.procs)
        assert len(procs) == 2
        assert all(os.getpriority(os.PRIO_PROCESS, p.pid) == 19 for p in procs)
    assert all(p.returncode is not None for p in procs)  # killed and reaped


def test_peer_workloads_have_the_shapes_the_comparison_names() -> None:
    from core.llms.demo import build
    from engine.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(build("llama-tiny")))
    chat = peer.workload("chat", tokenizer, 1.0)
    assert len(chat["prompts"]) == 64
    assert all(len(p) <= 300 for p in chat["prompts"])
    assert all(16 <= n <= 256 for n in chat["max_tokens"])
    cls = peer.workload("classification", tokenizer, 1.0)
    assert len(cls["prompts"]) == 256
    assert all(p[:400] == cls["prompts"][0][:400] for p in cls["prompts"])
    assert len({tuple(p[400:]) for p in cls["prompts"]}) > 200
    assert all(1 <= n <= 8 for n in cls["max_tokens"])
    long = peer.workload("long", tokenizer, 1.0)
    assert [len(p) for p in long["prompts"]] == [1500] * 16
    assert long["max_tokens"] == [128] * 16
    assert peer.workload("long", tokenizer, 1.0) == long  # the same requests every run
    assert peer.agreement([[1, 2], [3]], [[1, 2], [4]]) == 0.5
