"""Decode steps replayed as CUDA graphs at bucketed batch sizes (flex backend on CUDA).

A decode-only step of ``n`` sequences runs in the graph of the smallest bucket ``b >= n``, its
inputs copied into that bucket's static buffers. Rows ``n .. b-1`` are padding that own only
the runner's scratch block, so padding never touches a real sequence's cache. Buffers and
padding are plain tensor code, tested on CPU; capture and replay need CUDA. When capture
fails, the runner logs why and keeps running eagerly. See docs/engine-step.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.paged import AttentionContext, FlexStep
from engine.core.step import StepBatch

log = logging.getLogger("engine")


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch`` (which is always a bucket)."""
    buckets = [b for b in (1, 2, 4) if b < max_batch]
    buckets += list(range(8, max_batch, 8))
    buckets.append(max_batch)
    return sorted(set(buckets))


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds ``n`` rows; None when ``n`` exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    return None


@dataclass(slots=True)
class StaticDecode:
    """The fixed-address inputs and output of one bucket's graph."""

    size: int
    input_ids: torch.Tensor  # [b]
    positions: torch.Tensor  # [b]
    slot_mapping: torch.Tensor  # [b]
    q_seq: torch.Tensor  # [b] int32: row i is sequence i
    block_to_logical: torch.Tensor  # [b, cache_blocks + 1] int32
    pad_table: torch.Tensor  # [cache_blocks + 1] int32: a padding row owns the scratch block only
    logits: torch.Tensor | None = None  # [b, vocab], written by the step
    graph: Any = None


class DecodeGraphs:
    def __init__(self, runner: Any, max_batch: int) -> None:
        """``runner``: the ``ModelRunner`` whose decode steps these graphs replay."""
        self.runner = runner
        self.buckets = graph_buckets(min(max_batch, runner.config.max_num_seqs))
        self.static: dict[int, StaticDecode] = {}
        self.pool: Any = None
        self.failed: str | None = None

    def buffers(self, size: int) -> StaticDecode:
        r = self.runner
        dev = r.device
        cache_blocks = r.num_blocks + 1
        pad_table = torch.full((cache_blocks + 1,), -1, dtype=torch.int32, device=dev)
        pad_table[r.scratch_block] = 0
        return StaticDecode(
            size=size,
            input_ids=torch.zeros(size, dtype=torch.long, device=dev),
            positions=torch.zeros(size, dtype=torch.long, device=dev),
            slot_mapping=torch.full(
                (size,), r.scratch_block * r.block_size, dtype=torch.long, device=dev
            ),
            q_seq=torch.arange(size, dtype=torch.int32, device=dev),
            block_to_logical=pad_table.expand(size, -1).clone(),
            pad_table=pad_table,
        )

    def load(self, s: StaticDecode, batch: StepBatch) -> None:
        """Copy a decode-only step of ``n <= s.size`` rows into the buffers; pad the rest."""
        n = batch.num_tokens
        step = batch.ctx.flex
        assert step is not None
        s.input_ids[:n].copy_(batch.input_ids)
        s.input_ids[n:].zero_()
        s.positions[:n].copy_(batch.positions)
        s.positions[n:].zero_()
        s.slot_mapping[:n].copy_(batch.ctx.slot_mapping)
        s.slot_mapping[n:].fill_(self.runner.scratch_block * self.runner.block_size)
        s.block_to_logical[:n].copy_(step.block_to_logical)
        s.block_to_logical[n:].copy_(s.pad_table)

    def step(self, s: StaticDecode) -> torch.Tensor:
        """The forward that is captured: reads only the static buffers."""
        r = self.runner
        flex = FlexStep(s.q_seq, s.positions.to(torch.int32), s.block_to_logical, r.block_size)
        ctx = AttentionContext(r.k_cache, r.v_cache, s.slot_mapping, r.backend, flex=flex)
        out = r.base(
            input_ids=s.input_ids.unsqueeze(0),
            position_ids=s.positions.unsqueeze(0),
            use_cache=False,
            batchd_ctx=ctx,
        )
        return r.logits(out.last_hidden_state[0])

    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """Logits of a decode-only step through a graph, or None to run it eagerly."""
        if self.failed is not None:
            return None
        size = bucket_for(batch.num_tokens, self.buckets)
        if size is None:
            return None
        s = self.static.get(size)
        if s is None:
            s = self._capture(size, batch)
            if s is None:
                return None
        self.load(s, batch)
        s.graph.replay()
        assert s.logits is not None
        return s.logits[: batch.num_tokens]

    def _capture(self, size: int, batch: StepBatch) -> StaticDecode | None:
        s = self.buffers(size)
        self.load(s, batch)
        try:
            stream = torch.cuda.Stream(self.runner.device)
            stream.wait_stream(torch.cuda.current_stream(self.runner.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: compile kernels, settle allocations
                    self.step(s)
            torch.cuda.current_stream(self.runner.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                s.logits = self.step(s)
            self.pool = graph.pool()
            s.graph = graph
        except Exception as exc:  # any capture failure means: run eagerly
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed, decode steps run eagerly: %s", self.failed)
            return None
        self.static[size] = s
        log.info("captured the decode CUDA graph for batch size %d", size)
        return s
