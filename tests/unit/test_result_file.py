"""The result file (_serialize/result_file.py) and results saved by --export."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import enot_nb
from enot_nb._serialize import result_file


def test_result_layout_round_trip_keeps_aliasing_and_holds_no_descriptor():
    base = torch.arange(10.0)
    value = {"base": base, "view": base[2:5], "param": torch.nn.Parameter(torch.ones(3))}
    fd = os.memfd_create("test")
    try:
        size = result_file.write_result(fd, *result_file.dump_result(value))
        before = len(os.listdir("/proc/self/fd"))
        loaded = result_file.read_result(fd, size)
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        os.close(fd)
    assert torch.equal(loaded["base"], base) and isinstance(loaded["param"], torch.nn.Parameter)
    loaded["base"][3] = 100  # a view and its base still share a storage
    assert loaded["view"][1].item() == 100


def test_numpy_and_torch_memory_stays_shared_through_a_round_trip():
    x = np.arange(6.0)
    u = torch.arange(6.0)
    sent = (x, torch.from_numpy(x), torch.from_numpy(x[2:]), u, u.numpy(), u.view(2, 3).T.numpy())
    data, buffers = result_file.dump_result(sent)
    x2, t2, tail2, u2, a2, c2 = pickle.loads(data, buffers=buffers)
    t2.add_(1)
    assert x2.tolist() == [1, 2, 3, 4, 5, 6] and tail2.tolist() == [3, 4, 5, 6]
    u2.mul_(10)
    assert a2.tolist() == [0, 10, 20, 30, 40, 50] and c2.tolist() == [[0, 30], [10, 40], [20, 50]]
    data, buffers = result_file.dump_result(torch.from_numpy(np.ones(2)))
    alone = pickle.loads(data, buffers=buffers)
    assert alone.tolist() == [1, 1]  # its array did not travel: the tensor comes by value


def test_a_results_file_saved_before_the_modules_moved_still_loads(tmp_path):
    """tests/data/results_9af6e15.pkl was written by commit 9af6e15's --export code (its rebuild
    functions named ``enot_nb._pickling.*``; see tests/data/make_results_9af6e15.py)."""
    data = Path(__file__).resolve().parents[1] / "data" / "results_9af6e15.pkl"
    assert b"enot_nb._pickling" in data.read_bytes()
    (tmp_path / "train.results.pkl").write_bytes(data.read_bytes())
    loaded = enot_nb.load_results(tmp_path / "train.py")
    base, view, weight, tagged = loaded["base"], loaded["view"], loaded["weight"], loaded["tagged"]
    assert base.dtype == torch.float64
    assert base.tolist() == [[0.25, 1.75, 3.25, 4.75], [6.25, 7.75, 9.25, 10.75], [12.25, 13.75, 15.25, 16.75]]
    assert view.tolist() == [[6.25, 9.25], [12.25, 15.25]] and view.stride() == (4, 2)
    base[1, 2] = -1.0  # the view is still a view of base's storage
    assert view[0, 1].item() == -1.0 and view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert type(weight) is torch.nn.Parameter and weight.requires_grad and weight.tolist() == [3.5, -2.25, 7.0]
    assert weight.grad.tolist() == [0.5, -0.125, 1.0]
    assert type(tagged).__name__ == "Tagged" and isinstance(tagged, torch.Tensor) and tagged.note == "kept"
    assert tagged.dtype == torch.int32 and tagged.tolist() == [10, 20, 30]
    array, from_numpy, tail = loaded["array"], loaded["from_numpy"], loaded["array_tail"]
    assert array.dtype == np.float32 and array.tolist() == [-1, 2, 5, 8, 11, 14]
    from_numpy.add_(1)  # still one memory with the array, and with its view
    assert array.tolist() == [0, 3, 6, 9, 12, 15] and tail.tolist() == [6, 9, 12, 15]
    counts, counts_numpy = loaded["counts"], loaded["counts_numpy"]
    counts.mul_(2)
    assert counts_numpy.dtype == np.int64 and counts_numpy.tolist() == [14, 16, 18, 20]
    assert loaded["ref"]() is base and loaded["plain"] == {"lr": 0.125, "steps": [1, 2, 3]}


def test_every_moved_name_is_where_the_table_says():
    import importlib

    from enot_nb._serialize import renamed

    for (old, name), new in renamed.MOVED.items():
        assert old.startswith("enot_nb.") and hasattr(importlib.import_module(new), name), (old, name, new)


def test_load_results_refuses_a_pickle_it_should_not_trust(tmp_path):
    """Unpickling runs code: load_results loads only a file of this user's that not anyone may
    write, and never through a symbolic link."""
    from enot_nb._serialize import result_file

    script = tmp_path / "job.py"
    results = tmp_path / "job.results.pkl"
    results.write_bytes(result_file.dump_inline({"x": torch.arange(3) * 7}))
    results.chmod(0o644)
    assert enot_nb.load_results(script)["x"].tolist() == [0, 7, 14]
    results.chmod(0o646)
    with pytest.raises(PermissionError, match="may be written by anyone"):
        enot_nb.load_results(script)
    results.chmod(0o600)
    elsewhere = tmp_path / "elsewhere.pkl"
    results.rename(elsewhere)
    results.symlink_to(elsewhere)
    with pytest.raises(PermissionError, match="symbolic link"):
        enot_nb.load_results(script)
    results.unlink()
    elsewhere.rename(results)
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(results, 12345, -1)
        with pytest.raises(PermissionError, match="owned by user id 12345"):
            enot_nb.load_results(script)
    results.unlink()
    os.mkfifo(results)  # would block an open that waits for a writer
    with pytest.raises(PermissionError, match="is not a regular file"):
        enot_nb.load_results(script)
