"""The registered adapters and the resident set.

Registered adapters are checked at once (engine/lora/adapter.py) and stay on disk. At most
``max_loras`` are resident (their weights prepared for the sites, engine/lora/layers.py); one is
made resident when the scheduler admits a request that uses it, evicting the least recently
used one that no running sequence holds. A sequence holds its adapter from admission until it
finishes, is preempted or suspended (:meth:`LoraManager.acquire`, :meth:`LoraManager.release`);
a request whose adapter cannot be made resident waits in the queue.

Each resident adapter has a slot; the resident set's weights are also kept stacked by slot
(engine/lora/layers.py, ``SiteStack``; packed for the CPU's GEMM like the base's layers),
rebuilt when an adapter is loaded, for the steps of few rows and several adapters."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from engine.cpu import linear as cpu_linear
from engine.lora.adapter import AdapterError, AdapterSpec, load_weights, read_adapter
from engine.lora.layers import (
    Linear,
    LoraStep,
    Site,
    SiteLinears,
    SiteStack,
    SiteWeights,
    prepare,
    prepared_numel,
    stack,
)

log = logging.getLogger("engine")

# A step of at most this many rows and more than one adapter goes through the stacked weights
# (two matmuls a site); a larger one, through each adapter's rows apart (see LoraStep).
STACKED_MAX_ROWS = 256
# A step whose adapted rows make at most this many contiguous ranges an adapter takes them as
# ranges (a prefill step); more, and they are gathered and scattered.
RUNS_PER_ADAPTER = 2


class LoraManager:
    def __init__(
        self,
        linears: dict[str, tuple[int, int]],
        attach: Callable[[], dict],
        *,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        rows_hint: int = 64,
        packing: str | None = None,
    ) -> None:
        # the base's adaptable layers, fixed with the model (read-only)
        self.linears: Mapping[str, tuple[int, int]] = MappingProxyType(dict(linears))
        self.rows_hint = rows_hint
        self.packing = packing  # the base's packing (engine/cpu/linear.py), for the stacks
        self._attach = attach
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.specs: dict[str, AdapterSpec] = {}
        # each resident adapter's shrink and expand of every site, least recently used first
        self.resident: OrderedDict[str, list[SiteLinears | None]] = OrderedDict()
        self.pins: dict[str, int] = {}  # running sequences holding each resident adapter
        self.slots: dict[str, int] = {}  # each resident adapter's slot in the stacks
        self.stacks: list[SiteStack | None] | None = None
        self.sites: list[Site] | None = None  # wrapped on the first registration
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.reserved_bytes = 0  # what the KV budget left for the resident set
        self.budgeted = False  # the KV budget was set (adapters registered later are not in it)
        self.num_loads = 0
        self.num_evictions = 0

    # -- registration ---------------------------------------------------------------------------

    def register(self, name: str, directory: str | Path) -> AdapterSpec:
        """Check and register an adapter; an adapter name is registered once."""
        known = self.specs.get(name) if isinstance(name, str) else None
        if known is not None:
            raise AdapterError(
                f"adapter {name!r} is already registered (from {str(known.directory)!r})"
            )
        spec = read_adapter(name, directory, self.linears, self.max_rank)
        if self.sites is None:
            self.sites = self._attach()["sites"]
        self.specs[name] = spec
        size = self.adapter_bytes(spec)
        if self.budgeted and self.needed_bytes(self.specs.values()) > self.reserved_bytes:
            log.warning(
                "LoRA adapter %r registered at runtime: the resident set may take %.1f MiB, "
                "more than the %.1f MiB the KV budget left for it (adapters named in "
                "lora_adapters are budgeted)",
                name,
                self.needed_bytes(self.specs.values()) / 2**20,
                self.reserved_bytes / 2**20,
            )
        log.info(
            "LoRA adapter %r registered: rank %d, %d modules, %.1f MiB when resident",
            name,
            spec.rank,
            len(spec.modules),
            size / 2**20,
        )
        return spec

    def adapter_bytes(self, spec: AdapterSpec) -> int:
        assert self.sites is not None
        ranks = {path: m.rank for path, m in spec.modules.items()}
        return prepared_numel(self.sites, ranks) * self.elem

    def needed_bytes(self, specs: Iterable[AdapterSpec]) -> int:
        """The memory a resident set of ``specs`` may take, ``max_loras`` slots of: the
        largest adapter (each resident adapter's own weights) and the stacks' slot (each
        layer at the largest rank any of them gives it)."""
        specs = list(specs)
        largest = max((self.adapter_bytes(s) for s in specs), default=0)
        ranks: dict[str, int] = {}
        for spec in specs:
            for path, module in spec.modules.items():
                ranks[path] = max(ranks.get(path, 0), module.rank)
        envelope = sum(r * sum(self.linears[path]) for path, r in ranks.items()) * self.elem
        return (largest + envelope) * self.max_loras

    def reserve_bytes(self, specs: Iterable[AdapterSpec]) -> int:
        """Reserve :meth:`needed_bytes` of ``specs`` (the adapters configured at start)."""
        self.reserved_bytes = self.needed_bytes(specs)
        self.budgeted = True
        return self.reserved_bytes

    def check(self, name: str) -> None:
        """A request's adapter must be registered."""
        if name not in self.specs:
            known = ", ".join(repr(n) for n in self.specs) or "none"
            raise AdapterError(f"unknown LoRA adapter {name!r}; registered adapters: {known}")

    # -- the resident set -----------------------------------------------------------------------

    def can_acquire(self, name: str) -> bool:
        """Whether ``name`` is resident or can be made so now."""
        if name in self.resident or len(self.resident) < self.max_loras:
            return True
        return any(not self.pins.get(n) for n in self.resident)

    def acquire(self, name: str) -> bool:
        """Hold ``name`` for a running sequence, making it resident (evicting the least recently
        used adapter no sequence holds) if needed; False if every slot is held."""
        if name not in self.resident:
            if len(self.resident) >= self.max_loras:
                victim = next((n for n in self.resident if not self.pins.get(n)), None)
                if victim is None:
                    return False
                del self.resident[victim]
                self.pins.pop(victim, None)
                self.slots.pop(victim)
                self.num_evictions += 1
                log.info("LoRA adapter %r evicted", victim)
            self.resident[name] = self._load(self.specs[name])
            used = set(self.slots.values())
            self.slots[name] = min(i for i in range(self.max_loras) if i not in used)
            self._restack()
        self.resident.move_to_end(name)
        self.pins[name] = self.pins.get(name, 0) + 1
        return True

    def release(self, name: str) -> None:
        count = self.pins.get(name, 0) - 1
        if count > 0:
            self.pins[name] = count
        else:
            self.pins.pop(name, None)

    def _prepare(self, spec: AdapterSpec) -> list[SiteWeights | None]:
        assert self.sites is not None
        scales = {path: m.scale for path, m in spec.modules.items()}
        return prepare(self.sites, load_weights(spec), scales, self.dtype, self.device)

    def _load(self, spec: AdapterSpec) -> list[SiteLinears | None]:
        """An adapter's shrink and expand of each site, packed as the base's layers are."""
        loaded: list[SiteLinears | None] = [
            None if w is None else (self._linear(w[0].T), self._linear(w[1].T))
            for w in self._prepare(spec)
        ]
        self.num_loads += 1
        log.info(
            "LoRA adapter %r loaded (%d of %d slots)",
            spec.name,
            len(self.resident) + 1,
            self.max_loras,
        )
        return loaded

    def _restack(self) -> None:
        assert self.sites is not None
        self.stacks = None  # the old stacks go before the new are built: a lower peak
        stacks = []
        prepared = {name: self._prepare(self.specs[name]) for name in self.resident}
        for site in self.sites:
            by_slot = {}
            for name, weights in prepared.items():
                modules = self.specs[name].modules
                ranks = [modules[p].rank if p in modules else 0 for p, _, _ in site.parts]
                by_slot[self.slots[name]] = (weights, ranks)
            stacks.append(stack(site, by_slot, self.max_loras, self._linear))
        self.stacks = stacks

    def _linear(self, weight: torch.Tensor) -> Linear:
        """``x @ weight.T``, packed as the base's layers are, if they are."""
        if self.packing is not None:
            try:
                packed = weight.contiguous()
                return cpu_linear.PackedLinear(packed, None, self.rows_hint, self.packing)
            except RuntimeError:
                pass
        w_t = weight.T.contiguous()
        return lambda x: torch.mm(x, w_t)

    @property
    def resident_bytes(self) -> int:
        own = sum(self.adapter_bytes(self.specs[name]) for name in self.resident) // self.elem
        stacked = sum(s.numel for s in self.stacks or [] if s is not None)
        return (own + stacked) * self.elem

    # -- a step ---------------------------------------------------------------------------------

    def step_for(self, parts: list[tuple[Any, int, int]]) -> LoraStep | None:
        """The adapted rows of a packed step whose parts are ``(sequence, first, end)`` in row
        order, laid out as :class:`LoraStep` says; None if no row has an adapter."""
        if not self.resident:
            return None
        groups: dict[str, list[int]] = {}
        runs: list[tuple[str, int, int]] = []  # contiguous rows of one adapter
        row = 0
        for seq, c0, end in parts:
            request = getattr(seq, "request", None)
            name = request.lora if request is not None else None
            n = end - c0
            if name is not None:
                groups.setdefault(name, []).extend(range(row, row + n))
                if runs and runs[-1][0] == name and runs[-1][2] == row:
                    runs[-1] = (name, runs[-1][1], row + n)
                else:
                    runs.append((name, row, row + n))
            row += n
        if not groups:
            return None
        if len(groups) > 1 and row <= STACKED_MAX_ROWS and self.stacks is not None:
            row_slot = [-1] * row
            for name, rows in groups.items():
                slot = self.slots[name]
                for r in rows:
                    row_slot[r] = slot
            slots = torch.tensor(row_slot, dtype=torch.long, device=self.device)
            return LoraStep(stacks=self.stacks, row_slot=slots)
        if len(runs) <= RUNS_PER_ADAPTER * len(groups):
            return LoraStep(runs=[(self.resident[name], a, b) for name, a, b in runs])
        order = [r for rows in groups.values() for r in rows]
        all_rows = torch.tensor(order, dtype=torch.long, device=self.device)
        segments = []
        start = 0
        for name, rows in groups.items():
            end = start + len(rows)
            segments.append((self.resident[name], start, end, all_rows[start:end]))
            start = end
        return LoraStep(all_rows, segments)

    def stats(self) -> dict[str, int]:
        return {
            "num_loras_registered": len(self.specs),
            "num_loras_resident": len(self.resident),
            "num_lora_loads": self.num_loads,
            "num_lora_evictions": self.num_evictions,
            "lora_memory_bytes": self.resident_bytes,
        }
