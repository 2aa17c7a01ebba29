"""What a cell reaches (enot_nb._state.reach), without a kernel: the walk follows the cell's
names, the notebook functions and classes they reach, and falls back to every name only where
code reads the namespace by name."""

from __future__ import annotations

import copy
import functools
import pickle

import pytest
import torch
from IPython.core.inputtransformer2 import TransformerManager

from enot_nb._memory.digests import digest
from enot_nb._state.kinds import ATOMS_MIN, OPS, Kind, held_still, kind_of, let_go, plain_pickle
from enot_nb._state.reach import cell_names, reach
from enot_nb._state.snapshot import Snapshot


def _ipython(cell: str) -> str:
    return TransformerManager().transform_cell(cell)


def _notebook(code: str) -> dict:
    """A namespace as a notebook holds it: its functions and classes are the notebook's."""
    namespace: dict = {"__name__": "__main__"}
    exec(code, namespace)
    return namespace


def _walked(namespace: dict, cell: str) -> set[str]:
    return set(reach(namespace, _ipython(cell)).names)


@pytest.mark.parametrize(
    "cell, names",
    [
        ("%time loss = train(model)", {"loss", "train", "model"}),
        ("%timeit -n 3 step(x)", {"step", "x"}),
        ("!ls {folder}", {"folder"}),
        ("y = [f(v) for v in data]", {"y", "f", "v", "data"}),
    ],
)
def test_the_names_of_a_cell_include_those_its_magics_and_commands_read(cell, names):
    found = cell_names(_ipython(cell))
    assert names <= found.names
    assert found.dynamic is None


@pytest.mark.parametrize(
    "cell, why",
    [
        ("globals()['x'] = 1", "globals"),
        ("print(eval('x'))", "eval"),
        ("exec('x = 1')", "exec"),
        ("vars()['x']", "vars"),
        ("import sys\nsys.modules['__main__'].x", "sys.modules"),
        ("import __main__", "__main__"),
        ("get_ipython().user_ns['x']", "get_ipython"),
        ("%who", "%who"),
        ("%run other.py", "%run"),
    ],
)
def test_code_that_reads_names_dynamically_is_named(cell, why):
    assert cell_names(_ipython(cell)).dynamic == why


def test_a_trivial_cell_walks_nothing_the_notebook_holds():
    namespace = _notebook(
        "samples = [(f'img{i}.jpg', i % 10) for i in range(5000)]\nbig = {i: {'a': i} for i in range(5000)}"
    )
    found = reach(namespace, "x = 1")
    assert found.names == [] and len(found.registry.objects) == 1  # the namespace alone


def test_globals_read_by_notebook_functions_are_reached_to_any_depth():
    namespace = _notebook(
        "import torch.nn.functional as F\nSCALE = [2.0]\nunused = [3]\n"
        "def inner(v):\n    return F.relu(v) * SCALE[0]\n"
        "def outer(v):\n    return inner(v)\n"
    )
    assert _walked(namespace, "y = outer(1)") == {"outer", "inner", "F", "SCALE"}


def test_an_instance_brings_its_class_and_what_its_methods_read():
    namespace = _notebook(
        "import torch\nimport torch.nn.functional as F\nBIAS = [1.0]\nLIMIT = [9]\nWRAPPED = [0]\nunused = [0]\n"
        "def helper(v):\n    return v\n"
        "class Base(torch.nn.Module):\n    def shift(self, x):\n        return x + BIAS[0]\n"
        "class Net(Base):\n"
        "    def __init__(self):\n        super().__init__()\n        self.l = torch.nn.Linear(2, 2)\n"
        "    def forward(self, x):\n        return self.shift(F.relu(self.l(x)))\n"
        "    @property\n    def limit(self):\n        return LIMIT[0]\n"
        "    @staticmethod\n    def make():\n        return helper(1)\n"
        "    @classmethod\n    def build(cls):\n        return WRAPPED\n"
        "net = Net()\n"
    )
    walked = _walked(namespace, "out = net(torch.ones(1, 2))")
    assert {"net", "torch", "F", "BIAS", "LIMIT", "helper", "WRAPPED"} <= walked
    assert "unused" not in walked
    registry = reach(namespace, "net").registry
    assert registry.find(namespace["Net"]) is not None and registry.find(namespace["Base"]) is not None


def test_a_decorated_notebook_function_reaches_what_the_wrapped_one_reads():
    namespace = _notebook(
        "import functools\nTABLE = [1]\n"
        "@functools.lru_cache\ndef sq(v):\n    return TABLE[0] * v * v\n"
        "def deco(f):\n    @functools.wraps(f)\n    def wrapper(*a):\n        return f(*a)\n    return wrapper\n"
        "OTHER = [2]\n@deco\ndef g(v):\n    return OTHER[0] + v\n"
    )
    assert {"sq", "TABLE"} <= _walked(namespace, "sq(2)")
    assert {"g", "OTHER"} <= _walked(namespace, "g(2)")


def test_a_function_that_reads_names_dynamically_walks_every_name():
    namespace = _notebook("a = [1]\nb = [2]\ndef lookup(name):\n    return globals()[name]\n")
    found = reach(namespace, "lookup('a')")
    assert found.whole == "lookup uses globals"
    assert {"a", "b", "lookup"} <= set(found.names)


def test_a_large_container_of_atoms_is_one_object_compared_by_its_slots():
    samples = [(f"img{i}.jpg", i % 10) for i in range(ATOMS_MIN)]
    assert kind_of(samples) is Kind.ATOMS
    assert kind_of(samples[: ATOMS_MIN - 1]) is Kind.LIST
    assert kind_of([*samples, [1]]) is Kind.PLAIN  # a list of plain data: one object, digested
    assert kind_of([*samples, Box()]) is Kind.LIST  # an object among them: walked as any list
    assert kind_of({i: float(i) for i in range(ATOMS_MIN)}) is Kind.ATOMS
    namespace = {"samples": samples, "zeros": [0.0] * ATOMS_MIN}
    registry = reach(namespace, "samples, zeros").registry
    assert len(registry.objects) == 3  # the namespace and the two lists, not their items
    snapshot = Snapshot.take(registry)
    assert snapshot.changed_objects(registry) == []
    samples[5] = ("img5.jpg", 5)  # an equal tuple, but another object: reported (it travels)
    namespace["zeros"][7] = -0.0  # equal to 0.0, yet a change that must come back
    assert snapshot.changed_objects(registry) == [1, 2]


def test_a_large_container_is_told_plain_once_while_nothing_changes_it():
    """A walk, a snapshot and a push each ask whether a log is plain data; while held still they
    share one pickle (its digest is of those bytes), and a change after is seen."""
    log = [{"step": i, "loss": float(i), "tags": {"a"}} for i in range(ATOMS_MIN)]
    with held_still():
        first = plain_pickle(log)
        assert first is not None and kind_of(log) is Kind.PLAIN
        assert plain_pickle(log) is first  # not pickled again
        assert OPS[Kind.PLAIN].snapshot(log) == [digest(first)]
    assert plain_pickle(log) is not first and plain_pickle(log) == first
    with held_still():
        plain_pickle(log)
        let_go()  # the cell's code runs from here: nothing it learned holds, nor is learned
        first = plain_pickle(log)
        log[0]["step"] = -1
        assert plain_pickle(log) != first
    assert kind_of([pickle.PickleBuffer(b"x")] * ATOMS_MIN) is Kind.LIST  # (it would come back a bytearray)
    log.append(torch.zeros(1))
    assert kind_of(log) is Kind.LIST  # no longer plain: walked as any list
    assert kind_of([*copy.deepcopy(log[:-1]), (1, 1j, range(3), slice(2), ...)]) is Kind.PLAIN  # atoms' types
    assert kind_of([*copy.deepcopy(log[:-1]), Box()]) is Kind.LIST
    assert kind_of([*log[:-1], (1, 2)]) is Kind.LIST  # its records are log's too: aliases stay aliases
    records = copy.deepcopy(log[:-1])
    last = records[-1]
    assert kind_of(records) is Kind.LIST  # ``last = records[-1]`` holds one from outside
    del last
    assert kind_of(records) is Kind.PLAIN


def test_an_item_held_from_outside_at_any_level_or_twice_inside_is_found():
    """A large container is plain data only while no list, dict, set or bytearray inside it, at
    any level, is held from outside it or twice inside it (then it is walked item by item)."""
    from enot_nb._state.kinds import _held_from_outside

    nested = [{"i": i, "tags": [i, "a"]} for i in range(ATOMS_MIN)]
    mixed = [1, "a", *([i, {"c": i}] for i in range(ATOMS_MIN))]  # atoms beside containers
    by_key = {i: {"v": [i]} for i in range(ATOMS_MIN)}
    assert not any(map(_held_from_outside, (nested, mixed, by_key)))
    found = []
    for container, path in [(nested, (3,)), (nested, (3, "tags")), (mixed, (7, 1)), (by_key, (7, "v"))]:
        item = container
        for key in path:
            item = item[key]
        found.append(_held_from_outside(container))  # held by ``item`` alone
        del item
    assert found == [True] * 4
    assert not any(map(_held_from_outside, (nested, mixed, by_key)))
    nested.append(nested[0]["tags"])  # twice inside
    assert _held_from_outside(nested)


def test_plain_data_comes_back_in_place_sets_and_cycles_included():
    log = [{"step": i, "tags": {"a"}, "raw": bytearray(b"x")} for i in range(ATOMS_MIN)]
    log.append(log)  # a cycle: applied to a bounded depth, never forever
    assert kind_of(log) is Kind.LIST  # (it holds itself: held from outside too, so walked)
    tags, raw = log[3]["tags"], log[3]["raw"]
    new = [dict(d, step=-d["step"], tags={"b"}, raw=bytearray(b"y")) for d in log[:-1]] + [[1]]
    OPS[Kind.PLAIN].apply(log, new, None)
    assert log[3]["tags"] is tags and tags == {"b"} and log[3]["raw"] is raw and raw == b"y"
    assert log[3]["step"] == -3 and log[-1] == [1]  # the cycle let go, as the new state has it
    shared = {"x": 1}
    log = [shared, shared, *range(ATOMS_MIN)]
    OPS[Kind.PLAIN].apply(log, [{"x": 1}, {"x": 2}, *range(ATOMS_MIN)], None)
    assert log[0] is shared and shared == {"x": 1} and log[1] == {"x": 2}  # no longer one dict
    log = [shared, shared, *range(ATOMS_MIN)]
    again = {"x": 3}
    OPS[Kind.PLAIN].apply(log, [again, again, *range(ATOMS_MIN)], None)
    assert log[0] is shared and log[1] is shared and shared == {"x": 3}  # still one dict
    other = {"x": 4}
    log = [shared, other, *range(ATOMS_MIN)]
    OPS[Kind.PLAIN].apply(log, [again, again, *range(ATOMS_MIN)], None)
    assert log[0] is shared and log[1] is shared and other == {"x": 4}  # one dict now, as on the master


def test_reach_follows_a_partial_and_a_wrapped_function():
    namespace = _notebook("K = [3]\ndef f(a, b):\n    return K[0] + a + b\n")
    namespace["p"] = functools.partial(namespace["f"], 1)
    assert {"p", "K"} <= _walked(namespace, "p(2)")


def test_a_stop_press_anywhere_in_applying_the_changes_leaves_all_of_them_or_none():
    """The issue's tear: a press while the kernel copied the master's bytes into the notebook's
    tensors left some updated and others not. A press before any line of the apply (and of the
    kinds' apply functions it calls) must leave every change made, or none."""
    import sys

    from enot_nb._state import apply, collect, kinds
    from enot_nb._state.apply import apply_changes
    from tests._util import press_before_line

    namespace = {f"t{i}": torch.zeros(4) for i in range(4)} | {"log": [0]}
    registry = reach(namespace, "t0, t1, t2, t3, log").registry
    snapshot = Snapshot.take(registry)
    for i in range(4):
        namespace[f"t{i}"].fill_(i + 1)
    namespace["log"].append(1)
    changes, _ = collect.collect(registry, snapshot, dict(namespace), namespace)
    pickled, _ = collect.dump(changes, registry, {})
    pickled = collect.PickledState(pickled.main, [bytes(memoryview(b)) for b in pickled.buffers])

    def applied() -> list[bool]:
        return [bool(namespace[f"t{i}"].eq(i + 1).all()) for i in range(4)] + [namespace["log"] == [0, 1]]

    files = {apply.__file__, kinds.__file__}

    def run(press_at: int | None) -> int:
        for i in range(4):
            namespace[f"t{i}"].zero_()
        namespace["log"][:] = [0]
        loaded = apply.load(pickled, registry)
        where: list[str] = []
        seen, tracer = press_before_line(press_at, lambda code: code.co_filename in files, where)
        sys.settrace(tracer)
        try:
            apply_changes(namespace, registry, loaded, None)
            pressed = False
        except KeyboardInterrupt:
            pressed = True
        finally:
            sys.settrace(None)
        assert pressed == bool(where)
        assert applied() in ([True] * 5, [False] * 5), (where, applied())
        return seen[0]

    lines = run(None)
    assert applied() == [True] * 5 and lines > 20
    for k in range(1, lines + 1):
        run(k)


def _as_a_forked_master(work) -> bytes:
    """Run ``work()`` in a forked child, as a cell's master runs; its bytes come back by a pipe."""
    import os

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            data = work()
            os.write(write, len(data).to_bytes(8, "little"))
            view = memoryview(data)
            while view:
                view = view[os.write(write, view) :]
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        size = int.from_bytes(pipe.read(8), "little")
        data = pipe.read(size)
    os.waitpid(pid, 0)
    return data


def test_a_storage_comes_back_by_its_written_pages_even_with_a_live_child():
    """One element of 1 GiB written cost about 1 s and 1 GiB: the whole storage travelled. A
    live child of the master (DataLoader's persistent workers) made every storage count as
    written. Here: a 16 MiB storage, one element written before the master forks a child that
    stays alive and one after; only their pages travel, and applying them is exact."""
    import os
    import pickle

    from enot_nb._state import apply, collect

    big = torch.zeros(2**22)
    namespace = {"big": big}
    registry = reach(namespace, "big").registry

    def master() -> bytes:
        snapshot = Snapshot.take(registry)
        big[123_456] = 1.0
        hold, release = os.pipe()
        child = os.fork()  # alive while the changes are collected, as a DataLoader worker
        if child == 0:
            os.read(hold, 1)
            os._exit(0)
        big[3_000_000] = 2.0
        changes, _ = collect.collect(registry, snapshot, dict(namespace), namespace)
        pickled, _ = collect.dump(changes, registry, {})
        os.write(release, b"x")
        os.waitpid(child, 0)
        return pickle.dumps((pickled.main, [bytes(memoryview(b)) for b in pickled.buffers]))

    main, buffers = pickle.loads(_as_a_forked_master(master))
    assert 0 < sum(map(len, buffers)) <= 4 * 4096  # a page or two for each write
    changes = apply.load(collect.PickledState(main, buffers), registry)
    assert [s.whole for s in changes.storages] == [False]
    assert not apply.apply_changes(namespace, registry, changes, None)
    expected = torch.zeros(2**22)
    expected[123_456], expected[3_000_000] = 1.0, 2.0
    assert torch.equal(big, expected)


def test_attribute_names_are_not_globals():
    """model.eval() and m.data name attributes: they neither make the walk whole (eval) nor pull
    in a global of the same name (data)."""
    namespace = _notebook("data = [0]\ndef evaluate(m):\n    m.eval()\n    return m.data\n")
    found = reach(namespace, "evaluate(net)")
    assert found.whole is None and "data" not in found.names


@pytest.mark.parametrize(
    "setup, cell, changed",
    [
        ("h = [1]\npush = h.append\n", "push(3)", "h"),  # a bound C method reaches its object
        ("import torch\nacc = torch.zeros(2)\ninc = acc.add_\n", "inc(1)", "acc"),
        (
            "hist = []\ndef gen():\n    while True:\n        hist.append(1)\n        yield 1\ng = gen()\n",
            "next(g)",
            "hist",
        ),
        (
            "box = {'k': [1]}\ndef gen(b):\n    while True:\n        b['k'].append(2)\n        yield\ng = gen(box)\n",
            "next(g)",
            "box",
        ),
    ],
)
def test_what_a_cell_changes_through_a_bound_method_or_a_generator_is_reached(setup, cell, changed):
    namespace = _notebook(setup)
    registry = reach(namespace, cell).registry
    target = namespace[changed]
    assert registry.find(target) is not None or any(registry.find(v) is not None for v in target.values())


@pytest.mark.parametrize(
    "setup, cell", [("h = [1]\n", "locals()['h'].append(1)"), ("ns = globals()\nd = {}\n", "ns['d']['k'] = 1")]
)
def test_a_cell_that_reaches_the_namespace_itself_walks_every_name(setup, cell):
    found = reach(_notebook(setup), cell)
    assert found.whole is not None


class Box:
    """An object of the user's: a container holding one is walked."""
