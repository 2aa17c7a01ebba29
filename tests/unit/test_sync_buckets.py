"""sync_model's bucket planning (_runtime/sync.py)."""

from __future__ import annotations

import torch

from enot_nb._runtime.sync import _plan


def test_bucket_planning_packs_small_tensors_and_keeps_large_ones_alone():
    tensors = [torch.zeros(n) for n in (4, 4, 100, 4, 4, 4)]
    plan = _plan(tensors, capacity=8, in_place=lambda t: t.numel() >= 100)
    assert [[t.numel() for t in bucket] for bucket in plan] == [[100], [4, 4], [4, 4], [4]]
