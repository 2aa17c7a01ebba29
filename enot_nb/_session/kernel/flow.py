"""What flows between the notebook's namespace and a session's ranks, task by task.

Each task (a cell, ``launch``, ``pull``, ``push``) is made here, then sent by the session's
workers (_session/kernel/workers), then its outcome applied here::

    before: the push (what the notebook changed since the last sync, and the variables the task
            reaches that the ranks lack: _session/mirror/mirror), and, for a cell, the notebook's
            registry of what it reaches, as specs the master finds its own objects by
    after:  the master's changes applied in place (bring_back, as a one-off cell's), then the
            mirror's record of what the ranks hold; what did not come back is stale here

Under ``--mirror none`` nothing flows but what ``push`` and ``pull`` carry.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from enot_nb._launch.bring_back import BroughtBack, Bundle, bring_back
from enot_nb._launch.notes import NOTES, Note
from enot_nb._session.kernel.cell_reach import CellReach
from enot_nb._session.kernel.plain_cells import PlainCells
from enot_nb._session.kernel.workers import CommandOutcome
from enot_nb._session.mirror import paths
from enot_nb._session.mirror.mirror import Mirror, PickledTask, Push, SinceSync
from enot_nb._session.mirror.record import TaskChanges
from enot_nb._session.tasks import CallTask, CellTask, NotHeld, PullTask, SyncTask
from enot_nb._state import apply, reach
from enot_nb._state.collect import Changes
from enot_nb._state.kinds import held_still
from enot_nb._state.registry import Registry
from enot_nb._state.states import VALUE_TYPES
from enot_nb._worker import cell as _cell
from enot_nb.errors import LaunchConfigError, NotHeldError

MIRRORS = ("all", "none")
_COMPARE = object()
"""``_push``'s default: compare the notebook with the record first."""


@dataclass
class CellRun:
    """A session cell's per-cell options (the magic's, or ``Session.run``'s)."""

    output: str = "master"
    returns: list[str] | None = None
    no_return: bool = False
    sync: list[str] | None = None
    first_line: int = 1
    source_header: str = ""
    future_flags: int = 0
    """The notebook's ``from __future__`` features (see _cell.notebook_future_flags)."""
    check_replicas: bool = False
    """--check-replicas: the replicas compared across the ranks after the cell."""
    hang_after: float | None = None
    """--hang-after for this cell (0: never); None: the session's."""


@dataclass
class PreparedTask:
    """A task made, with what its outcome needs."""

    task: Any
    push: Push | None = None
    registry: Registry | None = None
    """The notebook's registry the master's changes are pickled against (a cell, a pull)."""
    reached: list[str] = field(default_factory=list)
    options: _cell.CellOptions | None = None
    code: str = ""
    run: CellRun | None = None
    reach: CellReach | None = None
    """A cell's reach and its specs, which the next cell may use again (see CellReach)."""
    still: dict[int, Any] | None = None
    """What the task's preparation learned of large containers (kinds.held_still): the record
    made after it reuses it where the task brought back nothing that can change them."""


class NamespaceFlow:
    """The notebook's namespace and what the ranks hold of it (see the module's docstring)."""

    def __init__(self, namespace: dict[str, Any], mode: str) -> None:
        self.namespace, self.mode, self.mirror = namespace, mode, Mirror()
        self.mirrored = mode == "all"
        self.kept: CellReach | None = None  # the last cell's reach, for the next (see CellReach)
        self.plain = PlainCells.of(namespace, lambda: self.mirror.synced_at) if self.mirrored else None

    def close(self) -> None:
        if self.plain is not None:
            self.plain.close()
            self.plain = None

    def _hidden(self) -> Any:
        return reach.hidden_names(self.namespace)

    def _compare(self) -> SinceSync | None:
        """What changed of the record since the last sync, looked for only where the plain
        cells run since can have changed it (see plain_cells)."""
        if not self.mirror.recorded(self.namespace):
            return None
        hidden = self._hidden()
        reached = self.plain.reached(self.namespace, hidden) if self.plain is not None else None
        return self.mirror.compare(self.namespace, hidden, reached)

    def pickle(self, prepared: PreparedTask) -> PickledTask:
        """The task pickled for the ranks; each variable its push left in the notebook (enot_nb's
        own objects, values that cannot be pickled) named once."""
        pickled = self.mirror.pickle(prepared.task, self.namespace)
        kept = {**(prepared.push.kept_here if prepared.push is not None else {}), **pickled.kept_here}
        for name, why in kept.items():
            NOTES.once(Note(name, f"{name!r} stays in the notebook, not on the ranks: {why}"))
        for name in prepared.push.detached if prepared.push is not None else []:
            NOTES.once(
                Note(
                    f"detached going out {name}",
                    f"{name}: reached the ranks without its autograd graph, which stays in the notebook "
                    "(a backward() through it there reaches no parameter); compute it inside the session cell",
                )
            )
        return pickled

    def _push(
        self,
        reached: list[str],
        pulling: list[str] | None = None,
        since: SinceSync | None | object = _COMPARE,
        overwrite: bool = False,
        keeping: list[str] | None = None,
    ) -> Push | None:
        """``since``: the comparison, where the caller made it already (None: no record)."""
        self.kept = None  # the task may change what it was made from
        if not self.mirrored:
            return None
        since = self._compare() if since is _COMPARE else since
        assert since is None or isinstance(since, SinceSync)
        return self.mirror.push(self.namespace, reached, self._hidden(), pulling, since, overwrite, keeping)

    def after_push(
        self,
        prepared: PreparedTask,
        outcome: CommandOutcome,
        names: list[str] | None = None,
        moved: TaskChanges | None = None,
        still: dict[int, Any] | None = None,
    ) -> None:
        """The ranks hold what was pushed, unless they could not apply it (or were replaced:
        new workers hold nothing). ``moved``: what the task brought back (the push is added);
        ``still``: what the task's preparation learned, where the task changed nothing here."""
        push = prepared.push
        if push is None or outcome.restart is not None:
            return
        if outcome.refused:
            self._push_refused(push, outcome)
            return
        if moved is not None:
            moved = moved.plus(push.changes, self.mirror.record.baseline)  # pickled against it: the same still
        with held_still(still):  # what came back is applied
            self.mirror.synced_after(self.namespace, [*push.names, *(names or [])], self._hidden(), moved)

    def _push_refused(self, push: Push, outcome: CommandOutcome) -> None:
        """A rank could not apply the push (the task ran nowhere): the variables it changed are
        stale, named once, and the record takes the notebook's values as they are, so the next
        task runs instead of retrying it (``%enot_pull NAME --keep-notebook`` tries again,
        ``--overwrite`` takes rank 0's)."""
        if push.changes is None:
            return
        failure = outcome.failures[0].summary() if outcome.failures else "the push was refused"
        why = f"its change here could not be applied on every rank: {failure}"
        names = [n for n in self.mirror.names_changed(push.changes) if n in self.namespace]
        self.mirror.left_on_master(self.namespace, dict.fromkeys(names, why))
        if names:
            print(
                f"enot_nb: {', '.join(names)}: the ranks keep their own value (the notebook's change could not "
                f"be applied); stale here until `%enot_pull NAME --overwrite` or `--keep-notebook`",
                file=sys.stderr,
            )
        self.mirror.synced_after(self.namespace, push.names, self._hidden())

    def cell(self, code: str, run: CellRun) -> PreparedTask:
        back = self.mirrored and not run.no_return
        options = _cell_options(run, back, names_only=self.mirrored and run.no_return)
        prepared = PreparedTask(task=None, options=options, code=code, run=run)
        mirror = None
        if self.mirrored:
            since = self._compare()
            reached = CellReach.of(
                self.namespace,
                code,
                self._hidden(),
                since,
                self.kept,
                rank_only=self.mirror.on_workers,
                synced=self.mirror.record.synced,
            )
            arrays = self.mirror.arrays_over_new_storages(self.namespace, reached.found.registry, self._hidden())
            if not set(arrays) <= set(reached.found.names):
                reached = CellReach.of(
                    self.namespace,
                    code,
                    self._hidden(),
                    since,
                    None,
                    rank_only=self.mirror.on_workers,
                    synced=self.mirror.record.synced,
                    also=arrays,
                )
            prepared.reached = reached.found.names
            prepared.push = self._push(reached.found.names, since=since)
            # --no-return too: the master snapshots what the cell reaches, to name what it changed
            prepared.registry, mirror = reached.found.registry, reached.specs()
            prepared.reach = reached if back else None
        prepared.task = CellTask(prepared.push.changes if prepared.push else None, code, options, mirror)
        return prepared

    def after_cell(self, prepared: PreparedTask, outcome: CommandOutcome) -> Any:
        """The master's changes in the notebook (also after a failure: its state then); the
        cell's value."""
        state = outcome.result if outcome.result is not None else outcome.partial
        if not isinstance(state, _cell.CellOutcome):
            self.after_push(prepared, outcome)
            return None
        self.mirror.on_device = set(state.on_device)  # the master's whole namespace, as of now
        assert prepared.options is not None and prepared.run is not None
        if prepared.registry is None or prepared.options.names_only:
            self.after_push(prepared, outcome)
            if prepared.options.names_only and outcome.restart is None:  # what it changed stays there
                self.mirror.left_on_master(self.namespace, dict.fromkeys(state.left_out, "left out by --no-return"))
            if outcome.result is not None and state.has_value and state.value_bundle:
                return Bundle(*state.value_bundle)
            return None
        brought = bring_back(
            self.namespace, prepared.registry, state, prepared.options, show_value=outcome.result is not None
        )
        if outcome.restart is None:  # new workers hold nothing yet
            moved = self._record(prepared, state, outcome, brought)
            if prepared.reach is not None and outcome.result is not None:  # the cell ended well
                self.kept = prepared.reach.kept_after(moved, self.mirror.record)
        return brought.value

    def _record(
        self,
        prepared: PreparedTask,
        state: _cell.CellOutcome,
        outcome: CommandOutcome,
        brought: BroughtBack,
    ) -> TaskChanges:
        """The ranks and the notebook agree on what came back; what did not is stale here. What
        came back into the notebook's objects."""
        returned = set(state.changed_names)
        left_out = dict.fromkeys(state.left_out, "left out by --return")
        names = self.mirror.came_back(self.namespace, {**state.not_returned, **left_out}, returned, prepared.reached)
        moved, push = TaskChanges.of(brought.changes, prepared.registry), prepared.push
        quiet = push is not None and push.changes is None and not (moved.objects or moved.storages or returned)
        if quiet and set(names) <= set(self.mirror.record.synced) and all(n in self.namespace for n in names):
            self.mirror.matched()  # nothing moved either way: the record still holds (and costs nothing)
            return moved
        self.after_push(prepared, outcome, names, moved, prepared.still if _atoms_only(brought, moved) else None)
        return moved

    # ------------------------------------------------------------------------- launch, pull, push

    def call(self, fn: Any, args: tuple, kwargs: dict) -> PreparedTask:
        """``launch(fn)``: the function's globals are pushed, and what it changes of them comes
        back, as a cell's."""
        if not callable(fn):
            raise LaunchConfigError(f"fn must be callable, got {type(fn).__name__}")
        prepared = PreparedTask(task=None, options=_cell.CellOptions(keep_on_error=True))
        mirror = None
        if self.mirrored:
            found = reach.reach(self.namespace, "", self._hidden(), found=reach.global_names(fn))
            prepared.reached, prepared.registry = found.names, found.registry
            prepared.push = self._push(found.names)
            mirror = paths.mirrored(found.registry)
        prepared.task = CallTask(prepared.push.changes if prepared.push else None, fn, args, kwargs, mirror)
        return prepared

    def after_call(self, prepared: PreparedTask, outcome: CommandOutcome) -> Any:
        """The master's changes in the notebook; fn's result on rank 0."""
        if prepared.registry is None:  # --mirror none: fn's result alone
            self.after_push(prepared, outcome)
            return outcome.result
        value, state = outcome.result if outcome.result is not None else (None, outcome.partial)  # the master's pair
        if not isinstance(state, _cell.CellOutcome):
            self.after_push(prepared, outcome)
            return value
        assert prepared.options is not None
        brought = bring_back(self.namespace, prepared.registry, state, prepared.options, show_value=False)
        if outcome.restart is None:
            self._record(prepared, state, outcome, brought)
        return value

    def pull(self, names: list[str], overwrite: bool = False) -> PreparedTask:
        """``pull(names)``; ``overwrite``: the master's values win over changes a plain cell made
        to stale ones (else those refuse it, see StaleError)."""
        _check_names(names)
        present = [n for n in names if n in self.namespace]
        registry = Registry.of_namespace(self.namespace, present)
        whole = (len(registry.objects), len(registry.storages))
        if self.mirrored:  # what a pulled value shares with the rest of the notebook stays shared
            held = sorted(n for n in self.mirror.record.synced if n in self.namespace and n not in present)
            registry.extend(held, self.namespace)
        mirror = paths.mirrored(registry)
        push = self._push([], pulling=list(names), overwrite=overwrite)
        task = PullTask(push.changes if push else None, list(names), mirror, whole)
        return PreparedTask(task, push, registry)

    def keep_notebook(self, names: list[str]) -> PreparedTask:
        """``pull(names, keep_notebook=True)``: the notebook's values of ``names`` sent to every
        rank in place of the master's (whole, in place: a conflict settled the notebook's way);
        a stale variable the notebook deleted is deleted on the ranks too. Another variable's
        conflict refuses nothing (it stays, asked about at the next cell)."""
        _check_names(names)
        stale = self.mirror.stale if self.mirrored else {}
        missing = [n for n in names if n not in self.namespace and n not in stale]
        if missing:
            raise LaunchConfigError(f"keep_notebook: the notebook has no variable {missing[0]!r} to send")
        if not self.mirrored:
            return self.push_values({n: self.namespace[n] for n in names})
        whole = self.mirror.notebook_wins(self.namespace, names)
        push = self._push([n for n in names if n in self.namespace], keeping=list(names))
        assert push is not None
        changes = push.changes or Changes()
        changes.objects = list({**dict(changes.objects), **dict(whole.objects)}.items())
        changes.storages = list({new.storage: new for new in [*changes.storages, *whole.storages]}.values())
        if changes.objects or changes.storages or changes.bound or changes.deleted:
            push.changes = changes
        return PreparedTask(SyncTask(push.changes, []), push)

    def still_in_conflict(self, prepared: PreparedTask, settled: list[str]) -> None:
        """After a pull: the conflicts it was to settle but did not (``settled``: the names now
        the same on both sides) are still asked about, though the record now takes the
        notebook's values (a refused push, a failed pull, a name that did not come back)."""
        if prepared.push is not None:
            self.mirror.conflicts |= (set(prepared.push.settles) - set(settled)) & set(self.mirror.stale)

    def after_keep_notebook(self, prepared: PreparedTask, outcome: CommandOutcome, names: list[str]) -> None:
        """The ranks hold the notebook's values of ``names``: they are current, their conflicts
        settled, and only then (see still_in_conflict)."""
        self.after_push(prepared, outcome)
        if outcome.failures or outcome.interrupted or outcome.refused or outcome.restart is not None:
            self.still_in_conflict(prepared, [])
            return
        self.mirror.refreshed(names)

    def after_pull(self, prepared: PreparedTask, outcome: CommandOutcome, names: list[str]) -> dict[str, Any]:
        self.after_push(prepared, outcome)
        if outcome.failures or outcome.interrupted or prepared.registry is None:
            self.still_in_conflict(prepared, [])
            return {}
        if isinstance(outcome.result, NotHeld):  # nothing pulled: what it was to settle stays asked about
            self.still_in_conflict(prepared, [])
            raise NotHeldError(outcome.result.missing, outcome.result.held)
        pulled, not_returned, whole = outcome.result
        changes = apply.load(pulled, prepared.registry)
        for line in apply.apply_changes(self.namespace, prepared.registry, changes, None):
            print(f"enot_nb: {line}", file=sys.stderr)
        not_returned |= _loaded_whole(self.namespace, whole)
        self.mirror.sharded |= {n for n in whole if n not in not_returned}
        for name, why in not_returned.items():
            print(f"enot_nb: {name!r} was not brought back: {why}", file=sys.stderr)
        came = [n for n in names if n not in not_returned and n in self.namespace]
        self.mirror.refreshed(came)
        self.still_in_conflict(prepared, came)
        if self.mirrored and outcome.restart is None:
            self.mirror.synced_after(self.namespace, [*self.mirror.record.synced, *came], self._hidden())
        return {n: self.namespace[n] for n in came}

    def push_values(self, values: dict[str, Any], to_device: list[str] | None = None) -> PreparedTask:
        """Under --mirror all the values are bound in the notebook too (it mirrors the master)
        and pushed by value, over whatever the ranks held; else only sent. ``to_device``: names
        each rank then moves onto its GPU (a restart's restore)."""
        if not self.mirrored:
            return PreparedTask(SyncTask(Changes(bound=dict(values)), list(to_device or [])))
        self.namespace.update(values)
        for name in values:
            self.mirror.stale.pop(name, None)
            self.mirror.record.synced.pop(name, None)
        push = self._push(list(values))
        return PreparedTask(SyncTask(push.changes if push else None, list(to_device or [])), push)


def _loaded_whole(namespace: dict[str, Any], whole: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Modules sharded on the ranks, pulled: each one's full values loaded into the notebook's
    own plain module of that name, in place (its parameters keep their identity); those that
    could not be, each with why."""
    import torch

    why = {}
    for name, values in whole.items():
        module = namespace.get(name)
        if not isinstance(module, torch.nn.Module):
            why[name] = (
                "it is sharded on the ranks, and its gathered values are loaded into the notebook's own "
                "module of that name, which the notebook does not hold: define (or push) the plain module first"
            )
            continue
        try:
            with torch.no_grad():
                module.load_state_dict(values)
        except Exception as err:  # noqa: BLE001 - named, the rest of the pull still lands
            why[name] = f"its gathered values do not fit the notebook's {type(module).__name__} ({err})"
    return why


def _atoms_only(brought: BroughtBack, moved: TaskChanges) -> bool:
    """Whether what came back can have changed no large container nor how it is held: no object
    or storage moved, no name deleted, and only atoms bound (an alias of an item, ``rec =
    log[5]``, makes ``log`` walked item by item from then on)."""
    changes = brought.changes
    if moved.objects or moved.storages:
        return False
    return changes is None or (not changes.deleted and all(type(v) in VALUE_TYPES for v in changes.bound.values()))


def _check_names(names: list[str]) -> None:
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise LaunchConfigError(f"pull({name!r}): expected variable names")


def _cell_options(run: CellRun, back: bool, names_only: bool) -> _cell.CellOptions:
    """How a session cell runs on the ranks (``back``: the master's changes come back;
    ``names_only``: only the names of what it changed, see CellOptions)."""
    return _cell.CellOptions(
        sync=run.sync,
        no_sync=run.sync is None,  # the ranks' models are in sync already
        returns=run.returns,
        no_return=not back and not names_only,
        names_only=names_only,
        first_line=run.first_line,
        source_header=run.source_header,
        future_flags=run.future_flags,
        shown=run.output != "none",
        keep_on_error=True,  # a failed session cell keeps what the master reached, as a local cell
        gather_sharded=False,  # the ranks' FSDP modules live on, sharded
        check_replicas=run.check_replicas,
    )
