"""The registered adapters and the resident set.

Registered adapters are checked at once (engine/lora/adapter.py) and stay on disk. At most
``max_loras`` are resident (their weights prepared for the sites, engine/lora/layers.py); one is
made resident when the scheduler admits a request that uses it, evicting the least recently
used one that no running sequence holds. A sequence holds its adapter from admission until it
finishes, is preempted or suspended (:meth:`LoraManager.acquire`, :meth:`LoraManager.release`);
a request whose adapter cannot be made resident waits in the queue."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from engine.lora.adapter import AdapterError, AdapterSpec, load_weights, read_adapter
from engine.lora.layers import LoraStep, Site, SiteWeights, prepare, prepared_numel

log = logging.getLogger("engine")


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
    ) -> None:
        self.linears = linears
        self._attach = attach
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.specs: dict[str, AdapterSpec] = {}
        self.resident: OrderedDict[str, list[SiteWeights | None]] = OrderedDict()  # LRU first
        self.pins: dict[str, int] = {}  # running sequences holding each resident adapter
        self.sites: list[Site] | None = None  # wrapped on the first registration
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.reserved_bytes = 0  # what the KV budget left for the resident set
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
        if self.reserved_bytes and size * self.max_loras > self.reserved_bytes:
            log.warning(
                "LoRA adapter %r takes %.1f MiB resident, more than the %.1f MiB a slot the KV "
                "budget reserved",
                name,
                size / 2**20,
                self.reserved_bytes / self.max_loras / 2**20,
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

    def reserve_bytes(self, specs: Iterable[AdapterSpec]) -> int:
        """The memory the resident set may take: ``max_loras`` slots of the largest adapter."""
        largest = max((self.adapter_bytes(s) for s in specs), default=0)
        self.reserved_bytes = largest * self.max_loras
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
                self.num_evictions += 1
                log.info("LoRA adapter %r evicted", victim)
            self.resident[name] = self._load(self.specs[name])
        self.resident.move_to_end(name)
        self.pins[name] = self.pins.get(name, 0) + 1
        return True

    def release(self, name: str) -> None:
        count = self.pins.get(name, 0) - 1
        if count > 0:
            self.pins[name] = count
        else:
            self.pins.pop(name, None)

    def _load(self, spec: AdapterSpec) -> list[SiteWeights | None]:
        assert self.sites is not None
        weights = load_weights(spec)
        scales = {path: m.scale for path, m in spec.modules.items()}
        prepared = prepare(self.sites, weights, scales, self.dtype, self.device)
        self.num_loads += 1
        log.info(
            "LoRA adapter %r loaded (%d of %d slots)",
            spec.name,
            len(self.resident) + 1,
            self.max_loras,
        )
        return prepared

    @property
    def resident_bytes(self) -> int:
        return sum(
            (w[0].numel() + w[1].numel()) * self.elem
            for weights in self.resident.values()
            for w in weights
            if w is not None
        )

    # -- a step ---------------------------------------------------------------------------------

    def step_for(self, parts: list[tuple[Any, int, int]]) -> LoraStep | None:
        """The adapted rows of a packed step whose parts are ``(sequence, first, end)`` in row
        order, grouped by adapter; None if no row has one."""
        if not self.resident:
            return None
        groups: dict[str, list[int]] = {}
        row = 0
        for seq, c0, end in parts:
            request = getattr(seq, "request", None)
            name = request.lora if request is not None else None
            if name is not None:
                groups.setdefault(name, []).extend(range(row, row + end - c0))
            row += end - c0
        if not groups:
            return None
        order = [r for rows in groups.values() for r in rows]
        all_rows = torch.tensor(order, dtype=torch.long, device=self.device)
        segments = []
        start = 0
        for name, rows in groups.items():
            end = start + len(rows)
            segments.append((self.resident[name], start, end, all_rows[start:end]))
            start = end
        whole = len(groups) == 1 and len(order) == row
        return LoraStep(all_rows, segments, whole)

    def stats(self) -> dict[str, int]:
        return {
            "num_loras_registered": len(self.specs),
            "num_loras_resident": len(self.resident),
            "num_lora_loads": self.num_loads,
            "num_lora_evictions": self.num_evictions,
            "lora_memory_bytes": self.resident_bytes,
        }
