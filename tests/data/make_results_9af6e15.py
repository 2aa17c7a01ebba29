"""Makes results_9af6e15.pkl: an exported run's results file as enot_nb wrote it before the
package was regrouped (commit 9af6e15, where the rebuild functions were ``enot_nb._pickling.*``).

Run it with that commit's package first on the path, once; the file is committed::

    git worktree add /tmp/enot_old 9af6e15
    PYTHONPATH=/tmp/enot_old python tests/data/make_results_9af6e15.py
    git worktree remove /tmp/enot_old

tests/unit/test_result_file.py loads it through enot_nb.load_results and checks every value.
"""

import sys
import weakref
from pathlib import Path

import numpy as np
import torch

from enot_nb import _pickling


class Tagged(torch.Tensor):
    """A notebook's tensor subclass (defined in __main__, so it travels by value)."""


def values() -> dict:
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4) * 1.5 + 0.25
    weight = torch.nn.Parameter(torch.tensor([3.5, -2.25, 7.0]))
    weight.grad = torch.tensor([0.5, -0.125, 1.0])
    tagged = torch.tensor([10, 20, 30], dtype=torch.int32).as_subclass(Tagged)
    tagged.note = "kept"
    array = np.arange(6, dtype=np.float32) * 3 - 1
    counts = torch.tensor([7, 8, 9, 10], dtype=torch.int64)
    return {
        "base": base,
        "view": base[1:, ::2],  # shares base's storage, at an offset, strided
        "weight": weight,
        "tagged": tagged,
        "array": array,
        "from_numpy": torch.from_numpy(array),  # shares the array's memory
        "array_tail": array[2:],  # a NumPy view of it
        "counts": counts,
        "counts_numpy": counts.numpy(),  # shares the tensor's memory
        "ref": weakref.ref(base),
        "plain": {"lr": 0.125, "steps": [1, 2, 3]},
    }


if __name__ == "__main__":
    assert _pickling.__file__.startswith("/tmp/enot_old"), _pickling.__file__
    target = Path(__file__).with_name("results_9af6e15.pkl")
    target.write_bytes(_pickling.dump_inline(values()))
    print(f"wrote {target} ({target.stat().st_size} bytes)", file=sys.stderr)
