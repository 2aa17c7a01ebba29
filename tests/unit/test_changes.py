"""What a cell changed (_state/snapshot.py, _state/collect.py), compared against its state."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from enot_nb._state import collect
from enot_nb._state.registry import Registry
from enot_nb._state.snapshot import Snapshot


def _changes(namespace: dict, cell: str) -> tuple[list[str], list[str], int]:
    """What a forked worker would report for ``cell`` (pages are told apart after a fork)."""
    registry = Registry.of_namespace(namespace, list(namespace))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker's side
        try:
            snapshot = Snapshot.take(registry)
            before = dict(namespace)
            exec(cell, namespace)
            changes, changed = collect.collect(registry, snapshot, before, namespace)
            found = (sorted(changes.bound), sorted(registry.path(i) for i in changed), len(changes.storages))
            os.write(write, pickle.dumps(found))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return pickle.loads(data)


def test_change_tracking_finds_what_changed_and_only_that():
    namespace = {
        "torch": torch,
        "model": torch.nn.Linear(2, 2),
        "log": [],
        "cfg": {"lr": 0.1},
        "arr": np.zeros(3),
        "big": torch.zeros(2**20),
    }
    bound, changed, storages = _changes(namespace, "log.append(1)\nmodel.weight.data.add_(1)\nz = 1")
    assert bound == ["z"] and changed == ["log"] and storages == 1
    bound, changed, storages = _changes(namespace, "model.eval()\narr[0] = 1\nbig[5] = 1")
    assert changed == sorted(["model", "arr"]) and storages == 1  # big's pages
    assert _changes(namespace, "pass") == ([], [], 0)


def _tensor_changes() -> list:
    """(name, tensor, change in place, whether its state changed) for the test below."""

    def hook(g):
        return g

    def removed_hook(t):
        t.register_hook(hook).remove()

    parameter = torch.nn.Parameter(torch.ones(4))
    with_hook = torch.ones(3, requires_grad=True)
    with_hook.register_hook(hook)
    return [
        ("nothing", torch.ones(4), lambda t: None, False),
        ("a write of its bytes", torch.ones(4), lambda t: t.add_(1), False),  # a digest's matter
        ("resized", torch.ones(4), lambda t: t.resize_(2), True),
        ("another storage", torch.ones(4), lambda t: t.set_(torch.zeros(4)), True),
        ("another offset", torch.ones(8), lambda t: t.set_(t.untyped_storage(), 2, (4,)), True),
        ("transposed", torch.ones(2, 3), lambda t: t.t_(), True),
        ("viewed as strided", torch.ones(6), lambda t: t.as_strided_((3,), (2,)), True),
        ("requires grad", torch.ones(4), lambda t: t.requires_grad_(), True),
        ("a grad", torch.ones(4, requires_grad=True), lambda t: setattr(t, "grad", torch.ones(4)), True),
        ("an attribute", torch.ones(4), lambda t: setattr(t, "tag", "x"), True),
        ("a hook", torch.ones(4, requires_grad=True), lambda t: t.register_hook(hook), True),
        ("a hook removed", with_hook, lambda t: t._backward_hooks.clear(), True),
        ("a hook added and removed", torch.ones(4, requires_grad=True), removed_hook, True),
        (
            "a post-accumulate hook",
            torch.ones(4, requires_grad=True),
            lambda t: t.register_post_accumulate_grad_hook(hook),
            True,
        ),
        ("its data replaced", parameter, lambda t: setattr(t, "data", torch.zeros(4)), True),
        ("a sparse tensor's values", torch.ones(2, 2).to_sparse(), lambda t: t._values().add_(1), False),
        (
            "a sparse tensor coalesced",
            torch.sparse_coo_tensor([[0, 0]], [1.0, 2.0], (2,), check_invariants=False),
            lambda t: t._coalesced_(True),
            True,
        ),
    ]


@pytest.mark.parametrize("name, tensor, change, changed", _tensor_changes(), ids=[c[0] for c in _tensor_changes()])
def test_a_tensor_compared_in_place_is_compared_as_its_state(name, tensor, change, changed):
    """The fast compare of a live tensor with its state (kinds._tensor_changed) says what
    building a state now and comparing the two (_same_tensor) says: a change or none."""
    from enot_nb._state import kinds
    from enot_nb._state.states import tensor_state

    before = tensor_state(tensor)
    change(tensor)
    assert kinds._tensor_changed(tensor, before) is changed, name
    assert kinds._same_tensor(before, tensor_state(tensor)) is not changed, name
    assert kinds._tensor_changed(tensor, tensor_state(tensor)) is False, name


def test_a_sets_item_is_registered_by_its_path_elsewhere_and_steps_follow_what_items_hold():
    """Set items are reached last, so an item reached elsewhere (a model's parameter) is found
    by that path; an item with no other path gets a step made of what it holds, the same in
    every process, never its place in an iteration."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False))
    ns = {"a_set": set(model.parameters()), "model": model, "fz": frozenset({Box(1), Box(2)})}
    registry = Registry.of_namespace(ns, ["a_set", "fz", "model"])
    for p in model.parameters():
        assert registry.path(registry.find(p)).startswith("model")
    steps = sorted(registry.parents[registry.find(b)][1] for b in ns["fz"])
    assert len(set(steps)) == 2 and all(s.startswith("<item Box ") for s in steps)
    twin = Registry.of_namespace({"fz": frozenset({Box(2), Box(1)})}, ["fz"])  # as a rank would hold it
    assert sorted(twin.parents[i][1] for i in range(2, len(twin.objects))) == steps


class Box:
    def __init__(self, v):
        self.v = v


def test_an_unchanged_generator_is_unchanged_wherever_its_state_tensor_lies():
    """A torch generator's snapshot is its state's bytes: pickling the state tensor named its
    storage by address, so an unchanged generator read "changed" when get_state's tensor lay
    elsewhere (after a stop press in a session: stale, then a conflict refusing every cell)."""
    g = torch.Generator().manual_seed(0)
    registry = Registry.of_namespace({"g": g}, ["g"])
    snapshot = Snapshot.take(registry)
    held = []
    for _ in range(5):
        held.append(torch.empty(g.get_state().numel(), dtype=torch.uint8))  # the next state lies elsewhere
        assert snapshot.changed_objects(registry) == []
    torch.randn(1, generator=g)
    assert snapshot.changed_objects(registry) == [registry.find(g)]
