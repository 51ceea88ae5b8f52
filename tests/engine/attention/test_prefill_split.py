"""A float32 prefill chunk that continues its sequence attends its cached keys and its own
keys apart, merged by their log-sum-exps (engine/attention/sdpa.py ``_continue``): the same
output as one masked SDPA call over all the keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention.paged import PrefillChunk
from engine.attention.sdpa import _continue, _splits


@pytest.mark.parametrize(("cached", "new"), [(1, 1), (15, 1), (16, 40), (37, 300), (900, 120)])
def test_two_parts_equal_one_masked_call(cached: int, new: int) -> None:
    torch.manual_seed(cached + new)
    heads, kv_heads, dim, block = 9, 3, 64, 16
    total = cached + new
    num_blocks = -(-total // block)
    order = torch.randperm(num_blocks + 4)[:num_blocks]  # the sequence's blocks, scattered
    k_cache = torch.randn(kv_heads, num_blocks + 4, block, dim)
    v_cache = torch.randn_like(k_cache)
    keys = k_cache[:, order].reshape(kv_heads, -1, dim)[:, :total].unsqueeze(0)
    values = v_cache[:, order].reshape(kv_heads, -1, dim)[:, :total].unsqueeze(0)
    q = torch.randn(1, heads, new, dim)
    chunk = PrefillChunk(0, new, context_len=total, blocks=order, first_pos=cached)
    assert _splits(q, None, None)
    got = _continue(q, keys[:, :, cached:], values[:, :, cached:], k_cache, v_cache, chunk, 0.125)
    mask = torch.arange(total)[None] <= torch.arange(cached, total)[:, None]
    want = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=0.125, enable_gqa=True
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_plain_float32_splits() -> None:
    q = torch.zeros(1, 2, 3, 8)
    assert _splits(q, None, None)
    assert not _splits(q, 64, None)  # a sliding window keeps the masked call
    assert not _splits(q, None, 30.0)  # so does soft-capping
    assert not _splits(q.bfloat16(), None, None)  # reduced precision would round twice
