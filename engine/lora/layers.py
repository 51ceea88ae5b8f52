"""Each row its own adapter, in one forward: the base model's linear layers wrapped so that the
rows of each adapter get ``scale * (x @ A^T) @ B^T`` added to the base output.

A *site* is one linear call of the forward: a plain linear layer (``o_proj``), or a fused one
(engine/forward/fusion.py: q/k/v or gate/up in one matmul), whose output columns are the parts
of several layers. An adapter's weights for a site are prepared once, when it is made resident:
the A of each part it adapts stacked (``[in, r_total]``), the B of each placed at its part's
columns, scale folded in (``[r_total, out]``, zero where a part is not adapted), so a fused
site's delta is two matmuls. The base's weights stay as they are (packed or not); nothing is
merged.

A step's adapted rows are laid out once (:class:`LoraStep`, built with the packed step): by
contiguous ranges, through the resident adapters' weights stacked by slot, or gathered and
scattered (Punica's and S-LoRA's way). Rows of the base model are not touched, and a step with
none of an adapter costs nothing."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from engine.forward.fusion import Slice


@dataclass(slots=True)
class Site:
    """One linear call: the module wrapped and the parts of its output (module path, first and
    end column)."""

    index: int
    in_features: int
    out_features: int
    parts: list[tuple[str, int, int]] = field(default_factory=list)


SiteWeights = tuple[torch.Tensor, torch.Tensor]  # (A^T [in, r], scale * B^T [r, out])
Linear = Callable[[torch.Tensor], torch.Tensor]
SiteLinears = tuple[Linear, Linear]  # an adapter's shrink (x @ A^T) and expand of one site


@dataclass(slots=True)
class SiteStack:
    """Every resident adapter's weights of one site side by side: ``shrink`` maps the input to
    every slot's ``x @ A^T`` (by part, then by slot, ``widths[p]`` columns a slot of part
    ``p``, zero past the adapter's rank; ``col_slot`` each column's slot), each of
    ``expands`` ``(first, end column of h, first, end output column, B)`` a part's columns to
    its part of the output: no matmul over a fused site's zero blocks."""

    widths: tuple[int, ...]
    col_slot: torch.Tensor
    shrink: Linear
    expands: list[tuple[int, int, int, int, Linear]]
    numel: int
    whole: bool  # one expand over every column of h and of the output


@dataclass(slots=True)
class LoraStep:
    """The adapted rows of one packed step, in one of three layouts:

    * ``runs``: each adapter's rows are a few contiguous ranges ``(weights, first, end)`` (a
      prefill step: its chunks are packed by adapter), each range two matmuls a site on a
      slice of the input, added to the same slice of the output;
    * ``stacks`` (a step of few rows and several adapters, a decode step): every row goes
      through every resident adapter's stacked weights in two matmuls a site, the slots not its
      own masked to zero (``row_slot``: each row's slot, -1 for the base): at a decode step's
      row counts the calls, not the arithmetic, cost the time, and this makes two a site
      whatever the number of adapters;
    * otherwise ``segments``: ``rows`` the packed rows grouped by adapter, gathered once a
      site; each adapter's ``(weights, first, end, its rows)`` two matmuls and one
      ``index_add_`` back into the output (Punica's and S-LoRA's gather and scatter).

    ``weights``: an adapter's shrink and expand of each site, None where it adapts nothing."""

    rows: torch.Tensor | None = None
    segments: list[tuple[list[SiteLinears | None], int, int, torch.Tensor]] = field(
        default_factory=list
    )
    runs: list[tuple[list[SiteLinears | None], int, int]] | None = None
    stacks: list[SiteStack | None] | None = None
    row_slot: torch.Tensor | None = None
    masks: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    def apply(self, site: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        if self.runs is not None:
            for weights, first, end in self.runs:
                w = weights[site]
                if w is not None:
                    y2[first:end].add_(w[1](w[0](x2[first:end])))
            return y
        if self.stacks is not None:
            stack = self.stacks[site]
            if stack is not None:
                h = stack.shrink(x2)
                h.mul_(self._mask(stack, h))
                if stack.whole:
                    y2.add_(stack.expands[0][4](h))
                else:
                    for c0, c1, lo, hi, expand in stack.expands:
                        y2[:, lo:hi].add_(expand(h[:, c0:c1].contiguous()))
            return y
        xs: torch.Tensor | None = None
        for weights, start, end, rows in self.segments:
            w = weights[site]
            if w is None:
                continue
            if xs is None:
                assert self.rows is not None
                xs = x2.index_select(0, self.rows)
            y2.index_add_(0, rows, w[1](w[0](xs[start:end])))
        return y

    def _mask(self, stack: SiteStack, h: torch.Tensor) -> torch.Tensor:
        """1 where a column belongs to the row's own slot, 0 elsewhere (built once for each
        layout of columns)."""
        mask = self.masks.get(stack.widths)
        if mask is None:
            assert self.row_slot is not None
            mask = (self.row_slot[:, None] == stack.col_slot[None, :]).to(h.dtype)
            self.masks[stack.widths] = mask
        return mask


class LoraState:
    """What every wrapped layer of one model reads: the running step's adapters, if any."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: LoraStep | None = None


class LoraLinear(torch.nn.Module):
    """A site's linear layer (plain or packed), its output plus the step's deltas."""

    def __init__(self, inner: torch.nn.Module, site: Site, state: LoraState) -> None:
        super().__init__()
        self.inner = inner
        self.site = site.index
        self.in_features, self.out_features = site.in_features, site.out_features
        self.__dict__["state"] = state
        self._forward = inner.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._forward(x)
        step = self.state.step
        if step is None:
            return y
        return step.apply(self.site, x, y)


def attach(
    model: torch.nn.Module, linears: Mapping[str, tuple[int, int]], state: LoraState
) -> dict:
    """Wrap every linear layer of ``model`` that ``linears`` names (paths in the causal LM, as
    loaded, before fusing) in a :class:`LoraLinear`; a fused set is one site. Returns the sites
    and each path's site: ``{"sites": [Site], "of": {path: (site index, first, end column)}}``."""
    sites: list[Site] = []
    of: dict[str, tuple[int, int, int]] = {}
    fused_sites: dict[int, Site] = {}
    for path, (in_features, out_features) in linears.items():
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        current = getattr(parent, leaf)
        if isinstance(current, Slice):
            fused = current.fused
            site = fused_sites.get(id(fused))
            if site is None:
                total = fused.bounds[-1][1]
                site = Site(len(sites), in_features, total)
                sites.append(site)
                fused_sites[id(fused)] = site
                fused.linear = LoraLinear(fused.linear, site, state)
            lo, hi = fused.bounds[current.index]
        else:
            site = Site(len(sites), in_features, out_features)
            sites.append(site)
            setattr(parent, leaf, LoraLinear(current, site, state))
            lo, hi = 0, out_features
        site.parts.append((path, lo, hi))
        of[path] = (site.index, lo, hi)
    return {"sites": sites, "of": of}


def prepare(
    sites: list[Site],
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
    scales: dict[str, float],
    dtype: torch.dtype,
    device: torch.device,
) -> list[SiteWeights | None]:
    """An adapter's ``(A, B)`` by module path as each site's ``(A^T, scale * B^T)``."""
    out: list[SiteWeights | None] = []
    for site in sites:
        parts = [(path, lo, hi) for path, lo, hi in site.parts if path in weights]
        if not parts:
            out.append(None)
            continue
        r_total = sum(weights[path][0].shape[0] for path, _, _ in parts)
        a_t = torch.empty(site.in_features, r_total)
        b_t = torch.zeros(r_total, site.out_features)
        col = 0
        for path, lo, hi in parts:
            a, b = weights[path]
            r = a.shape[0]
            a_t[:, col : col + r] = a.T
            b_t[col : col + r, lo:hi] = b.T * scales[path]
            col += r
        out.append((a_t.to(device, dtype).contiguous(), b_t.to(device, dtype).contiguous()))
    return out


def stack(
    site: Site,
    prepared: dict[int, tuple[list[SiteWeights | None], list[int]]],
    num_slots: int,
    linear: Callable[[torch.Tensor], Linear],
) -> SiteStack | None:
    """The resident adapters' weights of ``site`` side by side (see :class:`SiteStack`);
    ``prepared``: by slot, an adapter's weights of every site and its rank of each of this
    site's parts (0 where it does not adapt it). ``linear`` makes a linear layer of a weight
    ``[out, in]``."""
    entries: dict[int, tuple[SiteWeights, list[int]]] = {}
    for slot, (per_site, ranks) in prepared.items():
        w = per_site[site.index]
        if w is not None:
            entries[slot] = (w, ranks)
    if not entries:
        return None
    some = next(iter(entries.values()))[0][0]
    dtype, device = some.dtype, some.device
    widths = tuple(max(ranks[p] for _, ranks in entries.values()) for p in range(len(site.parts)))
    total = num_slots * sum(widths)
    a = torch.zeros(total, site.in_features, dtype=dtype, device=device)
    col_slot = torch.full((total,), -1, dtype=torch.long, device=device)
    expands = []
    numel = a.numel()
    offset = 0
    for p, (_, lo, hi) in enumerate(site.parts):
        width = widths[p]
        if width == 0:
            continue
        cols = num_slots * width
        b = torch.zeros(hi - lo, cols, dtype=dtype, device=device)
        for slot in range(num_slots):
            col_slot[offset + slot * width : offset + (slot + 1) * width] = slot
        for slot, ((a_t, b_t), ranks) in entries.items():
            first, r = sum(ranks[:p]), ranks[p]
            start = offset + slot * width
            a[start : start + r] = a_t[:, first : first + r].T
            b[:, slot * width : slot * width + r] = b_t[first : first + r, lo:hi].T
        expands.append((offset, offset + cols, lo, hi, linear(b)))
        numel += b.numel()
        offset += cols
    whole = len(expands) == 1 and expands[0][1] - expands[0][0] == total
    whole = whole and expands[0][3] - expands[0][2] == site.out_features
    return SiteStack(widths, col_slot, linear(a), expands, numel, whole)


def prepared_numel(sites: list[Site], ranks: dict[str, int]) -> int:
    """Elements an adapter of these module ``ranks`` takes once prepared (see :func:`prepare`)."""
    total = 0
    for site in sites:
        r_total = sum(ranks.get(path, 0) for path, _, _ in site.parts)
        total += r_total * (site.in_features + site.out_features)
    return total
