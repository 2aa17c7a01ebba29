"""A distributed cell is a local cell, for the tensors that are not plain strided views.

The differential suite of test_state_parity (its kernels, prelude and probes), over the tensors
and values that came back wrong: conjugate and negative views, sparse tensors changed in place,
quantized and inference-mode tensors, tensor hooks, -0.0 written where 0.0 was, and lazy
modules. Each probe reads what the bug lost, so the unfixed code fails it.
"""

from __future__ import annotations

import struct

import pytest

from enot_nb._state.states import same_value
from tests._util import METHODS
from tests.cells.test_state_parity import _fresh, assert_local_parity, under_magic

SPARSE = "dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])\n"

# (id, set-up, cell, probes, code run in both kernels after the cell and before the probes)
CASES = [
    (
        "conj-and-neg-views-made-in-cell",
        "",
        "z = torch.tensor([1 + 2j, 3 - 4j]).conj()\n"
        "mh = torch.tensor([[1 + 1j, 2j], [3 + 0j, 4 - 1j]]).mH\n"
        "nv = torch._neg_view(torch.tensor([1.0, 2.0]))",
        ["z.is_conj()", "z.tolist()", "mh.is_conj()", "mh.tolist()", "nv.is_neg()", "nv.tolist()"],
        "",
    ),
    (
        "conj-and-neg-views-of-notebook-tensors",
        "x = torch.tensor([1 + 2j, 3 - 4j])\nr = torch.tensor([1.0, 2.0])\nw = torch.tensor([1j])\n",
        "zc = x.conj()\nxh = x.view(2, 1).mH\nnv = torch._neg_view(r)\nw.data = w.conj()",
        # Written after the cell: the views still share the notebook's memory.
        [
            "zc.is_conj()",
            "zc.tolist()",
            "xh.is_conj()",
            "xh.tolist()",
            "nv.is_neg()",
            "nv.tolist()",
            "w.is_conj()",
            "w.tolist()",
        ],
        "x[0] = 5 + 6j\nr[1] = 7.0",
    ),
    (
        "sparse-coo-changed-in-place",
        SPARSE + "s = dense.to_sparse()\nalias = s\nv = dense.to_sparse().coalesce()\n",
        "s.mul_(2)\nv.values().fill_(7)",
        ["s.to_dense().tolist()", "alias is s", "v.to_dense().tolist()", "s.layout"],
        "",
    ),
    (
        "sparse-coo-gains-entries",
        SPARSE + "s = dense.to_sparse()\nalias = s\n",
        "s.add_(torch.eye(2).to_sparse())",
        ["s.to_dense().tolist()", "alias is s", "s._nnz()"],
        "",
    ),
    (
        "sparse-csr-changed-in-place",
        SPARSE + "c = dense.to_sparse_csr()\nalias = c\ngrown = dense.to_sparse_csr()\n",
        "c.values().mul_(3)\ngrown.add_(torch.eye(2).to_sparse_csr())",
        ["c.to_dense().tolist()", "alias is c", "c.layout", "grown.to_dense().tolist()", "grown._nnz()"],
        "",
    ),
    (
        "sparse-made-in-cell",
        SPARSE,
        "n = dense.to_sparse()\nnc = (dense * 2).to_sparse_csr()",
        ["n.to_dense().tolist()", "n.layout", "nc.to_dense().tolist()", "nc.layout"],
        "",
    ),
    (
        "quantized-made-in-cell",
        "",
        "q = torch.quantize_per_tensor(torch.tensor([1.0, 2.0, -3.0]), 0.1, 0, torch.qint8)\n"
        "pc = torch.quantize_per_channel(torch.ones(2, 2), torch.tensor([0.1, 0.2]), "
        "torch.tensor([0, 1]), 0, torch.quint8)",
        [
            "q.int_repr().tolist()",
            "q.q_scale()",
            "q.q_zero_point()",
            "q.dtype",
            "pc.int_repr().tolist()",
            "pc.q_per_channel_scales().tolist()",
            "pc.q_per_channel_zero_points().tolist()",
            "pc.dtype",
        ],
        "",
    ),
    (
        "inference-tensors",
        "with torch.inference_mode():\n    kept = torch.zeros(2)\n",
        "with torch.inference_mode():\n    inf = torch.ones(2) * 3\n    kept.add_(1)",
        ["inf.is_inference()", "inf.tolist()", "kept.is_inference()", "kept.tolist()"],
        "",
    ),
    (
        "hooks-registered-in-cell",
        "import torch.utils.hooks as th\nt = torch.ones(2, requires_grad=True)\nseen = []\n",
        # The worker's hook counter ahead of the notebook's, as after hooks it made itself: the
        # notebook's next hook must still not take the id of one the cell made (and replace it).
        # u's hook is the last made, and no handle to it comes back (its unpickling moves the
        # counter past its id).
        "th.RemovableHandle.next_id += 1000\nh = t.register_hook(lambda g: g * 2)\n"
        "u = torch.ones(2, requires_grad=True)\nu.register_hook(lambda g: seen.append(g.tolist()) or g * 3)\n"
        "u.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.tolist()))\ndone = True",
        # (1 * 2) + 1, then (h removed) 1 + 1; (1 * 3) + 1
        ["first", "second", "u.grad.tolist()", "seen"],
        "u.register_hook(lambda g: g + 1)\nt.register_hook(lambda g: g + 1)\n(t * 1).sum().backward()\n"
        "first = t.grad.tolist()\nh.remove()\nt.grad = None\n(t * 1).sum().backward()\n"
        "second = t.grad.tolist()\n(u * 1).sum().backward()",
    ),
    (
        "hook-added-to-a-tensor-with-hooks",
        # A fresh kernel's first hook: a spawned worker's counter starts there too.
        "import torch.utils.hooks as th\nth.RemovableHandle.next_id = 0\n"
        "t = torch.ones(2, requires_grad=True)\nt.register_hook(lambda g: g * 2)\n",
        "t.register_hook(lambda g: g + 1)",
        ["t.grad.tolist()", "len(t._backward_hooks)"],  # in order: (1 * 2) + 1, not (1 + 1) * 2
        "(t * 1).sum().backward()",
    ),
    (
        "notebook-hook-runs-in-cell",
        "p = torch.nn.Parameter(torch.ones(2))\np.register_hook(lambda g: g * 2)\nopt = torch.optim.SGD([p], lr=1.0)\n",
        "(p * 1).sum().backward()\nopt.step()",  # the hook runs in the worker: it travelled there
        ["p.grad.tolist()", "p.tolist()"],
        "",
    ),
    (
        "negative-zero-written-where-zero-was",
        "class Cfg:\n    pass\ncfg = Cfg()\ncfg.x = 0.0\nd = {'k': 0.0}\nitems = [0.0, 1.0]\n"
        "t = torch.zeros(2)\nzs = [0j]\n",
        "cfg.x = -0.0\nd['k'] = -0.0\nitems[0] = -0.0\nt[1] = -0.0\nzs[0] = complex(0.0, -0.0)",
        ["cfg.x", "d", "items", "t.tolist()", "zs"],
        "",
    ),
    (
        "lazy-module-left-alone",
        "lazy = torch.nn.LazyLinear(3)\n",
        "x = 1",
        ["x", "type(lazy).__name__", "type(lazy.weight).__name__"],
        "",
    ),
    (
        "lazy-module-materialized",
        "lazy = torch.nn.LazyLinear(3)\nweight = lazy.weight\n",
        "torch.manual_seed(2)\nout = lazy(torch.ones(2, 5))",
        [
            "type(lazy).__name__",
            "type(lazy.weight).__name__",
            "weight is lazy.weight",
            "lazy.in_features",
            "lazy.weight.tolist()",
            "lazy.bias.tolist()",
            "torch.equal(lazy(torch.ones(2, 5)), out)",
        ],
        "",
    ),
]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case_id, setup, cell, probes, after", CASES, ids=[c[0] for c in CASES])
def test_distributed_cell_is_a_local_cell(kernels, method, case_id, setup, cell, probes, after):
    assert_local_parity(kernels, method, case_id, setup, cell, probes, after)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", METHODS)
def test_a_hook_that_cannot_be_pickled_is_named_and_the_rest_comes_back(kernels, method):
    _, dist = kernels
    _fresh(dist)
    dist.ok("import threading\nt = torch.ones(2, requires_grad=True)")
    dist.ok(
        under_magic(method) + "lock = threading.Lock()\n"
        "t.register_hook(lambda g, lock=lock: g * 2)\nt.data.mul_(3)\nkept = 1"
    )
    notes = dist.ok("import enot_nb as __e\nprint(__e.last_notes())").stdout
    assert "was not brought back" in notes and "_thread.lock" in notes
    if method == "fork":  # a spawned master's registry has no paths: it names the change ''
        assert "'t' was not brought back" in notes
    assert dist.ok("print(t.tolist(), t._backward_hooks, kept)").stdout == "[3.0, 3.0] None 1\n"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", METHODS)
def test_a_sparse_tensor_made_in_a_cell_is_freed_when_the_notebook_drops_it(kernels, method):
    _, dist = kernels
    _fresh(dist)
    dist.ok(under_magic(method) + "n = torch.eye(2).to_sparse()")
    check = dist.ok("import gc, weakref\nref = weakref.ref(n)\ndel n\ngc.collect()\nprint(ref() is None)")
    assert check.stdout == "True\n"


# ----------------------------------------------------------------------------- same_value, fast


def _float(bits: int) -> float:
    """A new float object with these IEEE 754 bits."""
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


ZERO, NEGATIVE_ZERO, NAN, OTHER_NAN = 0, 1 << 63, 0x7FF8_0000_0000_0000, 0x7FF8_0000_0000_0001


@pytest.mark.parametrize(
    "a, b, same",
    [
        (_float(ZERO), _float(NEGATIVE_ZERO), False),  # == says equal
        (_float(NEGATIVE_ZERO), _float(NEGATIVE_ZERO), True),
        (_float(NAN), _float(NAN), True),  # == says different
        (_float(NAN), _float(OTHER_NAN), False),  # another payload
        (float("1.5"), float("1.5"), True),
        (_float(ZERO), 0, False),  # another type
        (complex(_float(ZERO), 1.0), complex(_float(NEGATIVE_ZERO), 1.0), False),
        (complex(1.0, _float(NAN)), complex(1.0, _float(NAN)), True),
        (complex(1.0, 2.0), complex(1.0, -2.0), False),
    ],
)
def test_floats_are_the_same_value_when_their_bits_are(a, b, same):
    assert a is not b  # two objects: identity cannot decide
    assert same_value(a, b) is same
    assert same_value([a], [a]) is False  # containers still compare by identity


# ----------------------------------------------------------------------------- tensors, fast


def test_an_uninitialized_parameter_is_tracked_and_takes_the_masters_materialized_state():
    import torch

    from enot_nb._state.kinds import apply_tensor
    from enot_nb._state.registry import Registry
    from enot_nb._state.snapshot import Snapshot
    from enot_nb._state.states import tensor_state

    lazy = torch.nn.LazyLinear(3)
    registry = Registry.of_namespace({"lazy": lazy}, ["lazy"])  # raised ValueError
    weight = lazy.weight
    assert registry.find(weight) is not None and Snapshot.take(registry).states[registry.find(weight)] is not None
    master = torch.nn.Parameter(torch.arange(6.0).view(3, 2))
    apply_tensor(weight, tensor_state(master), lambda text: pytest.fail(text))
    assert type(weight) is torch.nn.Parameter and weight.tolist() == master.tolist()


@pytest.mark.parametrize("make", ["conj", "neg", "inference"])
def test_a_tensor_keeps_its_conjugate_negative_and_inference_bits_through_its_reduction(make):
    import torch

    from enot_nb._serialize.tensors import reduce_tensor

    if make == "inference":
        with torch.inference_mode():
            t = torch.tensor([1.0, -2.0])
    else:
        base = torch.tensor([1 + 2j, 3 - 4j])
        t = base.conj() if make == "conj" else torch._neg_view(base)
    rebuild, args = reduce_tensor(t)[:2]
    back = rebuild(*args)
    assert (back.is_conj(), back.is_neg(), back.is_inference()) == (t.is_conj(), t.is_neg(), t.is_inference())
    assert back.tolist() == t.tolist() and back.untyped_storage() is t.untyped_storage()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_tensor_takes_new_parts_in_place(layout):
    import torch

    from enot_nb._state.kinds import apply_tensor
    from enot_nb._state.states import tensor_state

    def make(dense):
        return dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()

    notebook, master = make(torch.tensor([[0.0, 1.0], [2.0, 0.0]])), make(torch.tensor([[3.0, 0.0], [4.0, 5.0]]))
    before = tensor_state(notebook)
    assert before.storage is None and before.sparse is not None
    apply_tensor(notebook, tensor_state(master), lambda text: pytest.fail(text))
    assert notebook.layout == master.layout and notebook.to_dense().tolist() == [[3.0, 0.0], [4.0, 5.0]]


def test_a_tensor_keeps_its_hooks_through_its_reduction_and_their_ids_stay_taken():
    import torch
    from torch.utils.hooks import RemovableHandle

    from enot_nb._serialize.tensors import reduce_tensor

    t = torch.ones(2, requires_grad=True)
    handle = t.register_hook(lambda g: g * 2)
    rebuild, args, state, _, _, set_state = reduce_tensor(t)
    RemovableHandle.next_id = handle.id  # a process whose counter is behind the hooks' ids
    back = set_state(rebuild(*args), state)
    assert back._backward_hooks is t._backward_hooks and RemovableHandle.next_id == handle.id + 1
    (back * 1).sum().backward()
    assert back.grad.tolist() == [2.0, 2.0]
