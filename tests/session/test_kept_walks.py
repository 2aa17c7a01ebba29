"""The session's caches (a kept reach, a kept registry, a record updated in place, a kept
snapshot), each checked against the fresh walk it saves: the fresh walk is the oracle."""

from __future__ import annotations

import types

import pytest
import torch

from enot_nb._state.snapshot import Snapshot
from enot_nb.errors import WorkerFailedError
from tests.session.common import start

pytestmark = pytest.mark.timeout(120)


def _record_is_a_fresh_walk(mirror, namespace, where) -> None:
    """The mirror's record, however it was made (walked again or updated in place), is what a
    fresh walk of the synced names gives: the same objects and storages, each at a path that
    finds it, and a snapshot that sees no change now."""
    from enot_nb._session.mirror import paths
    from enot_nb._state.registry import Registry

    record, fresh = mirror.record.baseline, Registry.of_namespace(namespace, sorted(mirror.record.synced))
    assert {id(o) for o in record.objects} == {id(o) for o in fresh.objects}
    assert {id(s) for s in record.storages} == {id(s) for s in fresh.storages}
    found = paths.registry_at(namespace, paths.specs_of(record), len(record.objects), len(record.storages), strict=True)
    assert all(a is b for a, b in zip(found.objects, record.objects))
    snapshot = mirror.record.snapshot
    assert snapshot.changed_objects(record) == [], where
    assert snapshot.changed_storages(record) == [], where


def _walks_checked(monkeypatch) -> list[bool]:
    """Every session cell's reach, kept or walked, checked against a fresh walk (the oracle):
    the same names, objects, paths, storages and specs. Returns, for each cell, whether it used
    the last cell's kept reach."""
    from enot_nb._session.kernel.flow import NamespaceFlow
    from enot_nb._session.mirror import paths
    from enot_nb._state import reach

    prepare, uses = NamespaceFlow.cell, []

    def checked_cell(self, code, run):
        kept = self.kept
        prepared = prepare(self, code, run)
        uses.append(kept is not None and prepared.task.mirror is kept.mirror)
        fresh = reach.reach(self.namespace, code, self._hidden())
        assert prepared.reached == fresh.names, code
        assert [id(o) for o in prepared.registry.objects] == [id(o) for o in fresh.registry.objects], code
        assert prepared.registry.parents == fresh.registry.parents, code
        assert [id(s) for s in prepared.registry.storages] == [id(s) for s in fresh.registry.storages], code
        assert prepared.task.mirror.specs == paths.specs_of(fresh.registry), code
        return prepared

    monkeypatch.setattr(NamespaceFlow, "cell", checked_cell)
    return uses


def test_the_objects_a_cell_changed_found_again_are_what_a_fresh_find_gives():
    """A session master keeps its registry across a training cell by finding again only what the
    cell changed (paths.found_again): it must be exactly what finding every spec anew gives, or
    refuse (None) and leave the registry as it was; else the next cell's changes land on other
    objects, or a change is missed."""
    from enot_nb._session.mirror import paths
    from enot_nb._state.registry import Registry
    from enot_nb._state.snapshot import Snapshot

    def setup():
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
        model(torch.ones(2, 3)).sum().backward()
        base = torch.ones(4)
        ns = {"model": model, "log": [1.0, 2.0], "held": [torch.ones(1)], "x": torch.zeros(3, 3)}
        ns["views"] = [base[:2], base[2:]]  # two specs, one storage
        specs = paths.specs_of(Registry.of_namespace(ns, sorted(ns)))
        sizes = len(specs) + 1, len({j for spec in specs for j in spec.storages})
        registry = paths.registry_at(ns, specs, *sizes, strict=False)
        return ns, model, specs, sizes, registry, Snapshot.take(registry)

    def ids(registry):
        return [id(o) for o in registry.objects], [id(s) for s in registry.storages], list(registry.kinds)

    def changed_and_found(change):
        ns, model, specs, sizes, registry, snapshot = setup()
        before = ids(registry)
        change(ns, model)
        found = paths.found_again(registry, specs, snapshot.changed_objects(registry))
        if found is None:
            assert ids(registry) == before  # left as it was
            return None
        fresh = paths.registry_at(ns, specs, *sizes, strict=False)
        assert ids(registry) == ids(fresh)
        assert not paths.has_placeholders(registry)
        return found

    def step(ns, model):
        model.zero_grad()
        model(torch.ones(2, 3)).sum().backward()

    found = changed_and_found(step)  # four new .grad tensors, each where the old one was
    assert found is not None and len(found.objects) == 4 and len(found.storages) == 4
    found = changed_and_found(lambda ns, model: model[0].weight.data.mul_(2))  # bytes: nothing moves
    assert found is not None and found.objects == []

    found = changed_and_found(lambda ns, model: ns["log"].append(torch.ones(1)))  # atoms no more: another kind
    assert found is not None and found.objects == []

    def shared(ns, model):
        grad = torch.ones(3, 3)
        model[0].weight.grad, model[1].weight.grad = grad, grad  # one new tensor at two paths

    refused = {
        "a grad gone": lambda ns, model: model.zero_grad(set_to_none=True),
        "a list's tensor gone": lambda ns, model: ns["held"].__setitem__(0, 1.0),
        "another storage": lambda ns, model: setattr(model[0].weight, "data", torch.ones(3, 3)),
        "another storage size": lambda ns, model: setattr(model[0].bias, "grad", torch.ones(3).repeat(2)[:3]),
        "a new tensor at two paths": shared,
        "a new tensor where one of two views of a storage was": lambda ns, model: ns["views"].__setitem__(
            0, torch.zeros(4)[:2]
        ),
        "a registered tensor at another path": lambda ns, model: setattr(model[0].weight, "grad", ns["x"]),
    }
    for why, change in refused.items():
        assert changed_and_found(change) is None, why

    # The rank shares what the notebook does not (registry_at registered it once): finding only
    # what changed cannot give what a fresh find gives, so nothing is found again
    notebook = {"a": [torch.ones(4)], "b": [torch.ones(4)]}
    specs = paths.specs_of(Registry.of_namespace(notebook, sorted(notebook)))
    for why, second in {"a view of a[0]'s storage": lambda t: t.view(4), "a[0] itself": lambda t: t}.items():
        first = torch.ones(4)
        rank = {"a": [first], "b": [second(first)]}
        registry = paths.registry_at(rank, specs, len(specs) + 1, 2, strict=False)
        snapshot = Snapshot.take(registry)
        rank["a"][0] = torch.zeros(4)
        before = ids(registry)
        assert paths.found_again(registry, specs, snapshot.changed_objects(registry)) is None, why
        assert ids(registry) == before, why
    # A storage resized in place (its tensor unchanged) while a training step's grads move
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    rank = {"model": model, "x": torch.ones(4)}
    specs = paths.specs_of(Registry.of_namespace(rank, sorted(rank)))
    registry = paths.registry_at(rank, specs, len(specs) + 1, 5, strict=False)
    snapshot = Snapshot.take(registry)
    model.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    rank["x"].untyped_storage().resize_(64)
    before = ids(registry)
    assert paths.found_again(registry, specs, snapshot.changed_objects(registry)) is None
    assert ids(registry) == before


def test_a_kept_registry_is_found_by_its_specs_only_where_the_cell_changes_were_found_again():
    """The master's side of a kept registry (KeptSnapshot): after a training step (new .grad
    tensors) its registry is what finding the specs anew gives, and the next cell with the same
    specs gets it; after a cell whose change finding again refused (a tensor on another storage)
    the same specs must find the objects anew, whatever the notebook decided."""
    import pickle

    from enot_nb._memory.writes import WRITES
    from enot_nb._session.mirror import paths
    from enot_nb._session.mirror.kept import KeptSnapshot
    from enot_nb._session.tasks import RegistrySpecs
    from enot_nb._state.registry import Registry

    if not WRITES.available():  # nothing is kept where writes are not tracked
        pytest.skip("this kernel or sandbox refuses userfaultfd's asynchronous write protection")
    model = torch.nn.Linear(3, 3)
    model(torch.ones(2, 3)).sum().backward()
    ns = {"model": model}
    specs = paths.specs_of(Registry.of_namespace(ns, ["model"]))
    sizes = len(specs) + 1, len({j for spec in specs for j in spec.storages})
    mirror = pickle.loads(pickle.dumps(RegistrySpecs(specs, *sizes)))  # as the master loads it
    packed = mirror.packed
    kept = KeptSnapshot()
    registry = paths.registry_at(ns, specs, *sizes, strict=False)
    snapshot = Snapshot.take(registry)

    def cell(change) -> Registry | None:
        """``change`` run as a kept cell would be; the registry the next cell gets."""
        taken = kept.take(registry, scan_large=False)
        change()
        changed = taken.changed_objects(registry)
        kept.keep(registry, taken, changed, taken.changed_storages(registry))
        kept.found_by(packed, specs)
        kept.finish_retake()
        return kept.registry_for(ns, mirror)

    kept.keep(registry, snapshot, [], [])
    kept.found_by(packed, specs)
    assert kept.registry_for(ns, mirror) is registry

    def step() -> None:
        model.zero_grad()
        model(torch.ones(2, 3)).sum().backward()

    assert cell(step) is registry
    fresh = paths.registry_at(ns, specs, *sizes, strict=False)
    assert [id(o) for o in registry.objects] == [id(o) for o in fresh.objects]
    assert [id(s) for s in registry.storages] == [id(s) for s in fresh.storages]
    assert cell(lambda: setattr(model.weight, "data", torch.ones(3, 3))) is None


def test_a_reach_kept_after_a_cell_that_reorders_or_aliases_is_what_a_fresh_walk_gives(monkeypatch):
    """A session cell that puts a dict's key back at its end, or makes a registered object
    reachable by a new step that a walk meets first, moves no object: the paths the record holds
    still lead to them, but a walk registers them at other indices or by other steps. The next
    cell must use a reach that is what a walk gives (here: walked anew), and its changes must
    land on the objects they were made on."""
    uses = _walks_checked(monkeypatch)
    ns = {"__name__": "__main__", "torch": torch}
    with start("fork", namespace=ns) as s:
        s.run("d = {'k': torch.ones(2), 'j': [torch.ones(1)], 'z': {'deep': torch.ones(3)}}")
        s.run("torch\nd")
        s.run("torch\nd")
        assert uses[-1] is True  # nothing moved: kept
        s.run("torch\nd['k'] = d.pop('k')")  # the same objects, in another order
        s.run("torch\nd['k'].add_(1)\nd['j'][0].add_(2)")
        assert uses[-1] is False
        s.run("torch\nd['j'].append(d['z']['deep'])")  # a walk now meets it under 'j' first
        s.run("torch\nd['z']['deep'].add_(3)")
        assert uses[-1] is False
        s.run("torch\nd")
        assert uses[-1] is True
        here = {k: ns["d"][k].tolist() for k in ("k",)} | {"j0": ns["d"]["j"][0].tolist()}
        assert here == {"k": [2.0, 2.0], "j0": [3.0]}
        assert ns["d"]["j"][1] is ns["d"]["z"]["deep"] and ns["d"]["z"]["deep"].tolist() == [4.0] * 3
        assert list(ns["d"]) == ["j", "z", "k"]
        assert s.run("list(d), d['k'].tolist(), d['j'][0].tolist(), d['z']['deep'].tolist()") == (
            ["j", "z", "k"],
            [2.0, 2.0],
            [3.0],
            [4.0] * 3,
        )


def test_a_record_made_with_what_the_task_learned_before_is_a_fresh_walk():
    """After a task that brought back only atoms, the record reuses what the task's preparation
    learned of large containers (their plain pickles and whether an item is held from outside);
    after one that brought back an alias of an item, it looks again: a large list of records
    the ranks get in that task is walked item by item, as a fresh walk does."""
    records = {name: [{"i": i} for i in range(1200)] for name in ("log", "other")}
    s = start("fork", namespace=records)
    try:
        ns = s.namespace
        s.run("k = len(log)")  # log goes; only an atom comes back
        _record_is_a_fresh_walk(s.flow.mirror, ns, "after an atom came back")
        s.run("rec = other[5]")  # other goes; an alias of its item comes back
        _record_is_a_fresh_walk(s.flow.mirror, ns, "after an alias came back")
        assert ns["rec"] is ns["other"][5]
    finally:
        s.close()


def test_the_record_updated_after_a_task_is_the_record_walked_again(monkeypatch):
    """After each task the mirror updates its record where the task moved something (new names,
    written storages, objects that hold more) or walks it again (a name rebound, an object that
    holds less): either way it must be what a fresh walk gives, or the next push misses a change
    or refers to an object at a path that holds another."""
    from enot_nb._session.mirror.record import Record

    ns = {
        "model": torch.nn.Linear(3, 2),
        "log": [],
        "cfg": {"lr": 0.1},
        "big": torch.zeros(2**18),
        "box": types.SimpleNamespace(d={}),
    }
    updates: list[bool] = []
    update = Record.update

    def checked(self, namespace, synced, moved):
        updated = update(self, namespace, synced, moved)
        updates.append(updated)
        return updated

    monkeypatch.setattr(Record, "update", checked)
    steps = [
        ("cell", "n = sum(p.numel() for p in model.parameters())"),  # a new name
        ("cell", "n = n * 1000 + 1"),  # an atom rebound: nothing to walk again
        ("cell", "m = [n]\nn = 7"),
        ("cell", "m = {'k': m}"),  # a name rebound that held a list: walked again
        ("cell", "log.append(n)\nbig[5] = 1.0"),  # a list that holds more, a storage written
        ("plain", lambda: ns["big"].add_(1)),  # pushed: a storage
        ("cell", "opt = torch.optim.SGD(model.parameters(), lr=cfg['lr'], momentum=0.9)"),
        ("cell", "model(torch.ones(4, 3)).sum().backward()\nopt.step()"),  # grads, optimizer state
        ("cell", "opt.step()\nlog.append(float(model.weight.sum()))"),  # contents only
        ("plain", lambda: ns["cfg"].update(lr=0.2)),  # pushed: a dict's item
        ("cell", "cfg['extra'] = [1, 2]"),
        ("cell", "log.pop(0)"),  # a list that holds less: walked again
        ("cell", "model.bias = torch.nn.Parameter(torch.ones(2))"),  # another parameter
        ("plain", lambda: ns.__setitem__("cfg", {"lr": 0.3})),  # a synced name rebound
        ("cell", "cfg['lr'] += 1"),
        ("cell", "del cfg['lr']\nopt.zero_grad(set_to_none=True)"),
        # New objects where the old ones were (a training step's new .grad tensors): updated, the
        # new ones at the old ones' places, unless something else may still hold an old one.
        ("cell", TRAIN, True),
        ("cell", TRAIN, True),
        ("cell", "saved = [model.weight.grad]"),
        ("cell", TRAIN),  # the old grad stays in the record: the list holds it
        ("cell", "del saved"),
        ("cell", TRAIN),
        ("cell", "box.deep = {'a': {'b': [model.weight.grad]}}"),  # held deeper than its path
        ("cell", TRAIN, False),  # the old grad is still held, by a list the step did not move
        ("cell", "del box.deep"),
        ("cell", TRAIN),
        ("cell", TRAIN, True),
        ("cell", f"{TRAIN}\nbox.kept = model.weight.grad", False),  # a new grad held twice
        ("cell", TRAIN),
        ("cell", f"{TRAIN}\nbox.old = model.weight.grad\nmodel.weight.grad = model.weight.grad.clone()"),
        ("cell", "model.weight.grad = torch.zeros(2, 3)\nbox.new = model.weight.grad"),
        ("cell", "flat = torch.zeros(8)\nmodel.weight.grad = flat[:6].view(2, 3)\nmodel.bias.grad = flat[6:]"),
        ("cell", "model.weight.grad, model.bias.grad = torch.ones(2, 3), torch.ones(2)"),
        ("cell", "box.d = {}", True),  # an object that holds nothing, replaced
        ("cell", "box.d = {'a': [1]}", True),  # (what the new one holds is walked in)
        ("cell", "box.d = {}", False),  # the old one held a list
        ("cell", "box.d = {}\nbox.e = box.d", False),  # the new one is held twice
        ("cell", "box.d = {}", False),  # the old one is held by box.e still
        ("plain", lambda: ns["box"].__setattr__("d", {1: 2})),  # pushed: replaced in the record too
        ("cell", "box.d[3] = 4"),
    ]
    with start("fork", namespace=ns) as s:
        s.run("import torch")
        for kind, step, *expected in steps:
            if kind == "plain":
                step()
            else:
                s.run(step)
                _record_is_a_fresh_walk(s.flow.mirror, ns, (step, updates[-1:]))
                assert updates[-1:] == expected or not expected, (step, updates[-1:])
        seen = s.run(
            "float(big.sum()), len(log), sorted(cfg), opt.state_dict()['state'][0]['momentum_buffer'].tolist()"
        )
        assert seen == (
            float(ns["big"].sum()),
            len(ns["log"]),
            sorted(ns["cfg"]),
            ns["opt"].state[ns["model"].weight]["momentum_buffer"].tolist(),
        )
        assert ns["cfg"] == {} and len(ns["log"]) == 1
        box = ns["box"]
        assert s.run("box.d, sorted(box.e), box.new is model.weight.grad") == ({1: 2, 3: 4}, [], False)
        assert box.d == {1: 2, 3: 4} and box.e == {} and box.new is not ns["model"].weight.grad
        grads = s.run("[p.grad.tolist() for p in model.parameters()]")
        assert grads == [p.grad.tolist() for p in ns["model"].parameters()] == [[[1.0] * 3] * 2, [1.0] * 2]
    assert True in updates and False in updates  # both ways were taken


TRAIN = "opt.zero_grad()\nmodel(torch.ones(4, 3)).sum().backward()\nopt.step()"


FOUND_AGAIN: list[int] = []
"""The cells whose master used its kept registry (see the test below; the master's copy)."""


def test_a_reach_kept_from_the_last_cell_is_what_a_fresh_walk_gives(monkeypatch):
    """A cell that changed nothing leaves its reach (and the master its registry) for the next
    cell with the same names: each must be what walking (finding) anew would give, whatever a
    plain cell changed in between, or a change is missed or lands on another object."""
    from enot_nb._memory.writes import WRITES
    from enot_nb._session.mirror import paths
    from enot_nb._session.mirror.kept import KeptSnapshot

    if not WRITES.available():  # the master keeps a registry only where writes are tracked
        pytest.skip("this kernel or sandbox refuses userfaultfd's asynchronous write protection")

    uses = _walks_checked(monkeypatch)
    find = KeptSnapshot.registry_for

    def checked_find(self, namespace, mirror):  # in the master (forked from here)
        found = find(self, namespace, mirror)
        if found is not None:
            FOUND_AGAIN.append(1)
            again = paths.registry_at(namespace, mirror.specs, mirror.objects, mirror.storages, strict=False)
            assert [id(o) for o in found.objects] == [id(o) for o in again.objects]
            assert [id(s) for s in found.storages] == [id(s) for s in again.storages]
        return found

    monkeypatch.setattr(KeptSnapshot, "registry_for", checked_find)
    cell = (
        "try:\n    extra = len(helper)\nexcept NameError:\n    extra = -1\n"
        "out = repr((f(net), extra, float(net.weight.detach().sum())))"  # an atom: a tuple is rebound
    )
    ns = {"__name__": "__main__", "net": torch.nn.Linear(3, 2), "scale": 2, "table": {"k": 1}, "torch": torch}
    exec("def f(m):\n    return float(m.bias.detach().sum()) * scale + table['k']", ns)
    found_again = f"len(__import__('sys').modules[{__name__!r}].FOUND_AGAIN)"

    def local() -> str:
        extra = len(ns["helper"]) if "helper" in ns else -1
        return repr((ns["f"](ns["net"]), extra, float(ns["net"].weight.detach().sum())))

    plain_cells = [
        (None, True),  # nothing changed: kept
        (lambda: ns.update(scale=3), True),  # an atom rebound: it reaches nothing either way
        (lambda: ns.update(scale=torch.ones(1)), False),  # now an object: walked anew
        (lambda: ns.update(scale=2), False),  # the tensor is no longer reached
        (lambda: ns["table"].update(k=torch.ones(2)), False),  # a dict the function reads
        (lambda: setattr(ns["net"], "extra", torch.nn.Linear(1, 1)), False),  # a module holds more
        (lambda: ns.update(helper=[1, 2]), False),  # a name the cell names, absent until now
        (lambda: ns["net"].weight.data.add_(1), False),  # a storage written
        (lambda: exec("def f(m):\n    return float(m.weight.detach().sum())", ns), False),  # f rebound
        (lambda: ns.pop("helper"), False),  # absent again
        (lambda: ns.update(net=torch.nn.Linear(3, 2)), False),  # the same shapes, another model
        (None, True),
    ]
    with start("fork", namespace=ns) as s:
        s.run(cell)
        s.run(cell)
        for plain, kept in plain_cells:
            if plain is not None:
                plain()
            s.run(cell)
            assert uses[-1] is kept, (len(uses), uses)
            assert ns["out"] == local(), len(uses)
        s.run("net.weight.data.mul_(0)\n" + cell)  # a cell that wrote bytes: they move no path
        assert uses[-1] is True and ns["out"] == local() and float(ns["net"].weight.detach().sum()) == 0.0
        s.run(cell)
        assert uses[-1] is True and ns["out"] == local()
        s.run("net.weight.data = torch.ones(2, 3)\n" + cell)  # on another storage: walked (found) anew
        s.run(cell)
        assert uses[-1] is False and ns["out"] == local()
        # Training steps: each leaves new .grad tensors where the old ones were (kept, found again)
        ns["opt"] = torch.optim.SGD(ns["net"].parameters(), lr=0.1)
        step = "opt.zero_grad()\nnet(torch.ones(4, 3)).sum().backward()\nopt.step()\n" + cell
        before = s.run(found_again)
        for n in range(4):  # (no other session cell in between: it would leave its own reach)
            s.run(step)
            assert uses[-1] is (n > 1), (n, uses)  # the first walks the new name; the second the new grads
            assert ns["out"] == local()
        assert s.run("out") == ns["out"]
        grads = s.run("[p.grad.tolist() for p in net.parameters()]")
        assert grads == [p.grad.tolist() for p in ns["net"].parameters()]
        assert s.run(found_again) >= before + 2  # the master found its registry again after steps
        s.run(step.replace("opt.step()", "opt.step()\nopt.zero_grad()"))  # the grads gone again
        s.run(step)
        assert uses[-1] is False and ns["net"].weight.grad is not None and ns["out"] == local()
        # The master's side: its kept registry must not serve specs that name other objects now
        s.run("net.bias = type(net.bias)(net.bias.detach() + 1)\n" + cell)  # moved: found anew
        s.run(cell)
        twin = torch.nn.Linear(3, 2)  # the same specs, another model: bound by a push of names
        for mine, its in zip(twin.parameters(), ns["net"].parameters()):
            mine.grad = None if its.grad is None else its.grad.clone()  # (grads are in the specs)
        ns["net"] = twin
        s.run(cell)
        s.run("net.weight.data.add_(1)\n" + cell)
        assert ns["net"] is twin and ns["out"] == local() == s.run("out")
        assert s.run(found_again) >= 2  # the master found its kept registry too


GROWN: list[int] = []
"""The cells whose master grew its kept registry by new objects' specs (the master's copy)."""


def test_a_reach_grown_by_new_objects_is_what_a_fresh_walk_gives(monkeypatch):
    """A cell that appends to a list (or adds a dict's key) leaves its reach for the next cell
    grown by the new objects, and the master its registry grown by their specs, where a walk
    registers them after all else: each must be what walking (finding) anew gives, and a new
    object's later change must come back, and a plain cell's reach the ranks."""
    from enot_nb._memory.writes import WRITES
    from enot_nb._session.mirror import paths
    from enot_nb._session.mirror.kept import KeptSnapshot

    if not WRITES.available():  # the master keeps a registry only where writes are tracked
        pytest.skip("this kernel or sandbox refuses userfaultfd's asynchronous write protection")
    uses = _walks_checked(monkeypatch)
    find = KeptSnapshot.registry_for

    def checked_find(self, namespace, mirror):  # in the master (forked from here)
        parts = len(self.specs or ())
        found = find(self, namespace, mirror)
        if found is not None:
            GROWN.extend([1] * (0 < parts < len(mirror.packed)))
            again = paths.registry_at(namespace, mirror.specs, mirror.objects, mirror.storages, strict=True)
            assert [id(o) for o in found.objects] == [id(o) for o in again.objects]
            assert [id(s) for s in found.storages] == [id(s) for s in again.storages]
            assert self.take(found, scan_large=False).changed_objects(found) == []
        return found

    monkeypatch.setattr(KeptSnapshot, "registry_for", checked_find)
    ns = {"__name__": "__main__", "torch": torch, "log": [torch.zeros(2)], "zz": {"w": torch.ones(1)}}
    grown = f"len(__import__('sys').modules[{__name__!r}].GROWN)"
    append = "torch\nlog.append(torch.full((2,), float(len(log))))"
    with start("fork", namespace=ns) as s:
        for n in range(4):
            s.run(append)
            assert uses[-1] is (n > 0), (n, uses)  # the first walks; then grown, kept
        assert s.run(grown) >= 2  # the master grew its registry too
        s.run("torch\nlog[-1].add_(10)")  # a grown object, changed: comes back
        assert ns["log"][-1].tolist() == [14.0, 14.0]
        ns["log"][-2].mul_(3)  # a plain cell's change to one: reaches the ranks
        s.run(append)
        s.run(append)
        assert uses[-1] is True and len(ns["log"]) == 7
        assert s.run("[t.tolist() for t in log]") == [t.tolist() for t in ns["log"]]
        assert ns["log"][3].tolist() == [9.0, 9.0] and ns["log"][-1].tolist() == [6.0, 6.0]
        behind = "torch\nlog.append(torch.ones(1))\nzz"  # zz's tensor is walked after log's items
        s.run(behind)
        s.run(behind)
        assert uses[-1] is False and len(ns["log"]) == 9  # a walk gives another order: walked anew
        keyed = "torch\nzz[len(zz)] = torch.ones(1)"
        for _ in range(3):
            s.run(keyed)
        assert uses[-1] is True and list(ns["zz"]) == ["w", 1, 2, 3]
        assert s.run("sorted(map(str, zz)), len(log)") == (["1", "2", "3", "w"], 9)
        ns["t"] = torch.ones(2, requires_grad=True)
        ns["t"].note = torch.zeros(1)
        graded = "torch\nt.grad = torch.ones(2) if t.grad is None else t.grad * 2"
        s.run(graded)  # the new .grad comes before .note in a walk: walked anew
        s.run(graded)
        assert uses[-1] is False and ns["t"].grad.tolist() == [2.0, 2.0]
        ns["buf"] = torch.zeros(4)
        ns["head"] = ns["buf"][:2]  # a second tensor on the storage the cell resizes
        resized = "torch\nbuf.resize_(len(buf) + 100)\nhead"
        for _ in range(3):
            s.run(resized)
        assert uses[-1] is True and len(ns["buf"]) == 304 and ns["head"].untyped_storage().nbytes() == 304 * 4
        exec("def f():\n    return len(cfg)", ns)
        ns["cfg"], ns["items"] = [1, 2], [{"a": 0}]
        through = "torch\nitems.append({'a': f()})"  # cfg: walked in a later round, as f's global
        s.run(through)
        s.run(through)
        assert uses[-1] is False and ns["items"][-1] == {"a": 2}


def test_a_kept_registry_that_cannot_grow_is_dropped_whatever_fails():
    """The master's kept registry grown by specs it cannot follow (here a step no list has) is
    dropped, not left half grown: the next cell finds its objects anew."""
    from enot_nb._memory.writes import WRITES
    from enot_nb._session.mirror import paths
    from enot_nb._session.mirror.kept import KeptSnapshot
    from enot_nb._session.tasks import ObjectSpec, RegistrySpecs
    from enot_nb._state.registry import Registry

    if not WRITES.available():  # nothing is kept where writes are not tracked
        pytest.skip("this kernel or sandbox refuses userfaultfd's asynchronous write protection")
    ns = {"log": [torch.zeros(1)]}
    specs = paths.specs_of(Registry.of_namespace(ns, ["log"]))
    mirror = RegistrySpecs(specs, len(specs) + 1, 1)
    registry = paths.registry_at(ns, specs, mirror.objects, mirror.storages, strict=True)
    kept = KeptSnapshot()
    kept.keep(registry, Snapshot.take(registry), [], [])
    kept.found_by(mirror._packed(), specs)
    assert kept.registry_for(ns, mirror) is registry
    odd = ObjectSpec(mirror.objects, 1, "[one]", "torch.Tensor", (1,), (4,))
    assert kept.registry_for(ns, mirror.grown([odd], mirror.objects + 1, 2)) is None
    assert kept.registry is None and kept.snapshot is None


TAKES: list[int] = []
"""The snapshots a session's master took anew (see the test below; the master's copy)."""


def test_the_master_keeps_its_snapshot_from_cell_to_cell_and_still_sees_every_write(monkeypatch, pages):
    """A cell over the same objects as the last one starts from the master's kept snapshot
    (taken again only where the last cell changed something), where the kernel tracks writes;
    writes in place, through ``.data`` and through a NumPy view all come back; a push, a launch
    or a failed cell make the next one take it anew."""
    from enot_nb._state.snapshot import Snapshot

    original = Snapshot.take.__func__

    def counted(cls, registry, scan_large=False):
        TAKES.append(len(registry.objects))  # in the master: it is forked from here
        return original(cls, registry, scan_large)

    monkeypatch.setattr(Snapshot, "take", classmethod(counted))
    same = "torch, model, big, cfg, flag, losses\n"  # every cell reaches the same objects
    taken = same + f"len(__import__('sys').modules[{__name__!r}].TAKES)"
    ns = {"model": torch.nn.Linear(4, 4), "big": torch.zeros(2**19), "torch": torch, "cfg": {}, "flag": []}
    ns["losses"] = [0.5] * 1000  # an atoms container (one object), until it is cleared
    probe = same + "model.weight.tolist(), float(big[12345]), float(big[2**18])"
    with start("fork", namespace=ns) as s:
        s.run(same + "n = float(model.weight.sum()) + float(big.sum())")
        before = s.run(taken)
        for cell in [
            "with torch.no_grad():\n    model.weight[0, 0] = 5.0",
            "model.weight.data[1, 1] = 6.0",  # no version counter moves
            "big[12345] = 7.0",
            "big.numpy()[2**18] = 8.0",
        ]:
            s.run(same + cell)
            assert s.run(probe) == (ns["model"].weight.tolist(), float(ns["big"][12345]), float(ns["big"][2**18]))
        assert ns["model"].weight[1, 1] == 6.0 and float(ns["big"][2**18]) == 8.0
        fresh = s.run(taken) - before  # snapshots taken anew over the 9 cells since
        assert fresh <= 1 if pages == "tracked" else fresh >= 9, fresh
        before = s.run(taken)
        ns["n"] = 3  # a push that only binds a name changes no object: the snapshot is kept
        assert s.run(same + "n") == 3
        assert s.run(taken) - before == (0 if pages == "tracked" else 2)
        # What changes the master between two cells makes the next take its snapshot anew: else
        # a cell that writes back the kept value would look unchanged, and the notebook keep
        # the value from in between.
        # (Storages are safe either way: the kernel tells each write; an object's state is not.)
        s.run(same + "cfg['a'] = cfg['b'] = cfg['c'] = 3")
        ns["cfg"]["a"] = 0  # a plain change, pushed
        ns["n"] = 2  # a name rebound: alone, it would not make the master take its snapshot anew
        s.run(same + "cfg['a'] = 3")
        assert ns["cfg"]["a"] == 3
        s.launch(lambda: cfg.__setitem__("b", 0))  # noqa: F821 - the rank's variable
        s.run(same + "cfg['b'] = 3")
        assert ns["cfg"]["b"] == 3
        with pytest.raises(WorkerFailedError):
            s.run(same + "cfg['c'] = 0\nraise ValueError('x')")
        s.run(same + "cfg['c'] = 3")
        assert ns["cfg"] == {"a": 3, "b": 3, "c": 3} == s.run(same + "cfg")
        s.run(same + "flag.append(1)")  # kept: taken again where this cell changed it,
        s.run(same + "flag.clear()")  # or this one would match the state from before the last
        assert ns["flag"] == []
        s.run(same + "losses.clear()")  # its kind changes: the kept state is of the other kind
        s.run(same + "losses.append(1.0)")
        assert ns["losses"] == [1.0]
