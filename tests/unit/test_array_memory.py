"""Rebuilding a storage over the receiver's copy of an array: one memory where the copy is laid out as
the sender's array, the bytes sent beside it where it is not (never a storage over the wrong bytes)."""

from __future__ import annotations

import numpy as np
import torch

from enot_nb._serialize import tensors


def test_a_storage_over_a_strided_views_owner_is_that_owner_where_laid_out_as_the_senders():
    a = np.arange(6, dtype=np.float64)
    row = a[1::2]
    layout = (8, 48)  # row's offset in its owner, the owner's size, as the sender had them
    sent = np.arange(6, dtype=np.float64) + 10  # the sender's bytes, beside
    storage = tensors._storage_of_owner(row, 0, 48, layout, sent)
    torch.empty(0, dtype=torch.float64).set_(storage)[3:4].fill_(-1)
    assert a[3] == -1 and row[1] == -1

    shorter = np.arange(5, dtype=np.float64)[1::2]  # the receiver's owner holds fewer bytes
    apart = torch.empty(0, dtype=torch.float64).set_(tensors._storage_of_owner(shorter, 0, 48, layout, sent))
    assert apart.tolist() == sent.tolist()  # the sender's bytes, a storage of its own
    apart[0] = -5
    assert shorter.base.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert tensors._storage_of_owner(shorter, 0, 8).nbytes() == 8  # pickles made before the check
