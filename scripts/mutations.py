"""Break the code that a guarded test names, in a scratch copy of the tree, and check that the
test fails (tests/README.md). Each mutation is one text replacement; the copy is thrown away.

Usage: .venv/bin/python scripts/mutations.py [NAME ...]     (all of them by default; minutes)
Exit status 1 if a mutation left its tests green.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]


class Mutation(NamedTuple):
    name: str
    path: str
    old: str
    new: str
    tests: list[str]


MUTATIONS = [
    Mutation(
        # A large log's change dropped with its name though an item of it is still held.
        "plain-data-reached-through-items-dropped",
        "enot_nb/_session/mirror/mirror.py",
        "        kept |= _plain_holding(baseline, unreached, set(map(id, current.objects)))\n",
        "        pass\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found["
            "a-large-logs-item-written-then-the-log-deleted-fork]",
            "tests/session/test_session_parity.py::test_the_fuzzers_seeds_stay_found[71000086]",
        ],
    ),
    Mutation(
        # A view of a Fortran-ordered array goes as a C-ordered copy of its own, apart from it.
        "fortran-views-copied",
        "enot_nb/_serialize/tensors.py",
        "    if root is array or not (root.flags.c_contiguous or root.flags.f_contiguous):\n",
        "    if root is array or not root.flags.c_contiguous:\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found["
            "a-view-of-a-fortran-ordered-array-fork]",
        ],
    ),
    Mutation(
        # Every Ray result fetched by a call of its own, however small (a trivial cell's 1.2 ms).
        "ray-results-never-in-the-answer",
        "enot_nb/_launch/ray_agent.py",
        "            inline_results_up_to=INLINE_RESULT,\n",
        "",
        ["tests/ray_engine/test_ray_session.py::test_big_state_goes_both_ways_through_the_object_store"],
    ),
    Mutation(
        # Items of plain data looked up only in pickles that bind names: D['k'] = log[0] is a copy.
        "plain-items-only-where-names-are-bound",
        "enot_nb/_state/collect.py",
        "        self._carries_changes = bool(changes.objects) if isinstance(changes, Changes) else False\n",
        "        self._carries_changes = False\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found["
            "an-item-of-a-large-log-put-into-a-synced-dict-fork]",
        ],
    ),
    Mutation(
        # The receiver's owner laid out otherwise: a storage over the wrong bytes, silently.
        "storage-over-an-owner-laid-out-otherwise",
        "enot_nb/_serialize/tensors.py",
        "    if layout is None or (here == tuple(layout) and contiguous_memory(owner) is not None):\n",
        "    if True:\n",
        [
            "tests/unit/test_array_memory.py::"
            "test_a_storage_over_a_strided_views_owner_is_that_owner_where_laid_out_as_the_senders",
        ],
    ),
    Mutation(
        # A storage over the owner of a strided view the ranks hold travels as a copy.
        "storage-over-a-strided-views-owner-copied",
        "enot_nb/_serialize/tensors.py",
        "                if owner is not array and memory is not None and array.size and tensor_owned(array) "
        "is None:\n",
        "                if owner is not array and memory is not None and array.flags.c_contiguous:\n",
        [
            "tests/session/test_mirror.py::"
            "test_a_tensor_over_the_owner_of_a_strided_view_the_ranks_hold_shares_that_owner_there[tensor-first]",
            "tests/session/test_mirror.py::"
            "test_a_tensor_over_the_owner_of_a_strided_view_the_ranks_hold_shares_that_owner_there[array-first]",
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found["
            "a-tensor-over-the-owner-of-a-strided-view-that-went-first-fork]",
            "tests/session/test_session_parity.py::test_the_fuzzers_seeds_stay_found[69000455]",
        ],
    ),
    Mutation(
        "replica-check-compares-a-subgroup-ddp-across-the-world",
        "enot_nb/_worker/replicas.py",
        "    if _over_a_subgroup(ddp):\n",
        "    if False:\n",
        [
            "tests/diagnosis/test_replica_check.py::"
            "test_ddp_over_a_subgroup_is_named_not_compared_with_another_groups_replicas"
        ],
    ),
    Mutation(
        # The recorder said to be there when torch keeps none: the table has nothing to compare.
        "recorder-taken-for-on-when-off",
        "enot_nb/_worker/collectives.py",
        '    if os.environ.get("TORCH_FR_BUFFER_SIZE", "").strip() == "0":\n        return None\n',
        "",
        ["tests/diagnosis/test_collectives.py::test_without_the_recorder_the_groups_numbers_say_which_rank_is_behind"],
    ),
    Mutation(
        # IPython's debugger takes a KeyboardInterrupt for a fresh prompt: the rank never gets back.
        "debugger-asks-again-after-a-stop",
        "enot_nb/_worker/rank_input.py",
        "            raise bdb.BdbQuit from None\n",
        "            raise\n",
        [
            "tests/diagnosis/test_debugger.py::test_the_stop_button_at_a_prompt_and_a_peers_failure_close_the_debugger_and_keep_the_session[fork]"
        ],
    ),
    Mutation(
        "recorder-keeps-the-old-groups-numbers",
        "enot_nb/_session/worker/loop.py",
        "                collectives.forget_so_far()  # the new group's numbers start again\n",
        "                pass\n",
        ["tests/diagnosis/test_collectives.py::test_after_the_group_is_made_again_the_table_counts_on_the_new_group"],
    ),
    Mutation(
        "debug-takes-any-rank-number",
        "enot_nb/_session/kernel/session.py",
        "        if not 0 <= rank < ranks:\n",
        "        if False:\n",
        ["tests/diagnosis/test_debugger.py::test_input_on_the_master_reads_the_front_end[fork]"],
    ),
    Mutation(
        "rank-input-never-asks-the-notebook",
        "enot_nb/_session/worker/loop.py",
        "    rank_input.connect(_ask_the_notebook)\n",
        "    pass\n",
        ["tests/diagnosis/test_debugger.py::test_input_on_the_master_reads_the_front_end[fork]"],
    ),
    Mutation(
        # The debugger's output stays on the rank: under --output master rank 1's never shows.
        "debugger-output-not-sent-with-its-prompt",
        "enot_nb/_worker/rank_input.py",
        '        return read_line(prompt, shown + "\\n" if shown else "") + "\\n"\n',
        '        return read_line(prompt) + "\\n"\n',
        [
            "tests/diagnosis/test_debugger.py::test_a_breakpoint_on_rank_1_is_driven_from_the_notebook_and_quitting_keeps_the_session[fork]"
        ],
    ),
    Mutation(
        # A failure inside the post-mortem (no stdin) taken for the failure to debug next.
        "post-mortem-replaced-by-its-own-failure",
        "enot_nb/_session/worker/loop.py",
        "        if isinstance(command, RunTask) and not session.debugging:  # for a post-mortem (%enot_debug)\n",
        "        if isinstance(command, RunTask):\n",
        ["tests/diagnosis/test_debugger.py::test_a_post_mortem_opens_on_the_rank_that_raised[fork]"],
    ),
    Mutation(
        "collectives-table-never-reached-not-named",
        "enot_nb/_launch/collective_table.py",
        "            elif latest.seq < top.seq:\n",
        "            elif False:\n",
        [
            "tests/diagnosis/test_collectives.py::test_the_table_names_a_rank_that_never_reached_a_collective_and_where_it_is"
        ],
    ),
    Mutation(
        "collectives-not-in-the-stack-dump",
        "enot_nb/_worker/stacks.py",
        '("\\n".join(lines) + "\\n" + collectives.encoded(taken))',
        '("\\n".join(lines) + "\\n")',
        [
            "tests/diagnosis/test_collectives.py::test_a_mismatched_collective_is_named_when_the_ranks_hang_and_on_the_stop_press[fork]"
        ],
    ),
    Mutation(
        "hang-watch-never-finds-a-hang",
        "enot_nb/_launch/hang_watch.py",
        "        self._said = True\n        return True\n",
        "        self._said = True\n        return False\n",
        [
            "tests/diagnosis/test_collectives.py::test_a_hang_is_found_by_hang_after_and_the_cell_goes_on_in_a_session_and_a_one_off_cell[fork]"
        ],
    ),
    Mutation(
        # A rank busy computing taken for a hang: CPU time is not looked at.
        "hang-watch-ignores-cpu-time",
        "enot_nb/_launch/hang_watch.py",
        "        if moved:\n",
        "        if False:\n",
        [
            "tests/diagnosis/test_collectives.py::test_a_hang_is_found_by_hang_after_and_the_cell_goes_on_in_a_session_and_a_one_off_cell[fork]"
        ],
    ),
    Mutation(
        "timeout-sends-no-collectives",
        "enot_nb/_worker/bootstrap.py",
        "        timed_out = collectives.encoded(collectives.timed_out(exc))\n",
        '        timed_out = ""\n',
        ["tests/diagnosis/test_collectives.py::test_a_collective_that_times_out_shows_where_each_rank_stood[fork]"],
    ),
    Mutation(
        # Every rank's checksums taken for rank 0's: no drift is ever found.
        "replica-check-compares-the-master-with-itself",
        "enot_nb/_worker/replica_check.py",
        "    table = torch.stack(every).cpu()  # [rank, replica]\n",
        "    table = torch.stack([every[0]] * world).cpu()\n",
        [
            "tests/diagnosis/test_replica_check.py::test_a_drift_on_rank_1_is_named_with_its_rank_and_distance_and_nothing_is_changed[fork]"
        ],
    ),
    Mutation(
        # BatchNorm's running statistics, which DDP sends from rank 0 at each forward, counted as drift.
        "replica-check-resynced-buffers-count-as-drift",
        "enot_nb/_worker/replicas.py",
        "resynced and id(tensor) in buffers))",
        "False))",
        [
            "tests/diagnosis/test_replica_check.py::test_a_drift_on_rank_1_is_named_with_its_rank_and_distance_and_nothing_is_changed[fork]"
        ],
    ),
    Mutation(
        "replica-check-distance-not-measured",
        "enot_nb/_worker/replica_check.py",
        "        mine[j] = _max_abs_difference(local, master)\n",
        "        mine[j] = 1.0\n",
        [
            "tests/diagnosis/test_replica_check.py::test_a_drift_on_rank_1_is_named_with_its_rank_and_distance_and_nothing_is_changed[fork]"
        ],
    ),
    Mutation(
        "replica-check-not-run-after-a-cell",
        "enot_nb/_worker/cell.py",
        "            report = replica_check.check_replicas(namespace)\n",
        "            pass\n",
        [
            "tests/diagnosis/test_replica_check.py::test_a_one_off_cell_with_check_replicas_names_a_drift_and_the_sharded_state[fork]"
        ],
    ),
    Mutation(
        "ray-ranks-name-no-peers",
        "enot_nb/_launch/ray_ranks.py",
        "        return tuple(sorted(found))\n",
        "        return ()\n",
        [
            "tests/ray_engine/test_ray_session.py::"
            "test_a_stop_press_and_an_exception_keep_ddp_in_the_same_ranks_idle_or_loaded[idle]"
        ],
    ),
    Mutation(
        "ray-rank-may-connect-to-ray",
        "enot_nb/_worker/bootstrap.py",
        "    ray_rank.install()  # on Ray: the rank never connects to Ray itself\n",
        "    pass\n",
        [
            "tests/ray_engine/test_ray_session.py::test_a_rank_knows_its_place_from_ray_context_and_never_joins_ray_itself"
        ],
    ),
    Mutation(
        "ray-session-stop-keeps-its-connection",
        "enot_nb/_launch/ray_ranks.py",
        "        ray.shutdown()\n",
        "        pass\n",
        [
            "tests/ray_engine/test_ray_session.py::test_a_rank_knows_its_place_from_ray_context_and_never_joins_ray_itself"
        ],
    ),
    Mutation(
        "released-ranks-judged-by-the-clock-alone",
        "enot_nb/_session/kernel/workers.py",
        "            if not any(_grew(before.get(rank), now) for rank, now in after.items()):\n",
        "            if True:\n",
        ["tests/session/test_work_kept.py::test_released_ranks_that_work_their_way_back_slowly_are_waited_for"],
    ),
    Mutation(
        "a-death-shown-after-the-restart",
        "enot_nb/_session/kernel/workers.py",
        "        for r in dead:\n            if r.rank in self.said_dead:\n",
        "        for r in []:\n            if r.rank in self.said_dead:\n",
        [
            "tests/session/test_work_kept.py::"
            "test_a_peer_killed_mid_training_is_named_before_the_restart_idle_or_loaded[idle]"
        ],
    ),
    Mutation(
        "arrays-over-a-new-storage-left-behind",
        "enot_nb/_session/kernel/flow.py",
        "            if not set(arrays) <= set(reached.found.names):\n",
        "            if False:\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found"
            "[a-tensor-over-part-of-an-array-goes-with-the-array-fork]"
        ],
    ),
    Mutation(
        "a-record-after-an-alias-came-back-reuses-the-tasks-look",
        "enot_nb/_session/kernel/flow.py",
        "prepared.still if _atoms_only(brought, moved) else None",
        "prepared.still",
        ["tests/session/test_kept_walks.py::test_a_record_made_with_what_the_task_learned_before_is_a_fresh_walk"],
    ),
    Mutation(
        "an-item-held-twice-counted-once",
        "enot_nb/_state/kinds.py",
        "        if max(map(sys.getrefcount, containers)) > _REFS_HELD_ONCE + made:\n",
        "        if max(map(sys.getrefcount, containers)) > _REFS_HELD_ONCE + made + 1:\n",
        ["tests/cells/test_reach.py::test_an_item_held_from_outside_at_any_level_or_twice_inside_is_found"],
    ),
    Mutation(
        "containers-beside-atoms-counted-as-held-once-more",
        "enot_nb/_state/kinds.py",
        "map(type, items)))), made + 1\n",
        "map(type, items)))), made + 2\n",
        ["tests/cells/test_reach.py::test_an_item_held_from_outside_at_any_level_or_twice_inside_is_found"],
    ),
    Mutation(
        "attributes-a-pickle-leaves-out-walked",
        "enot_nb/_state/kinds.py",
        "    return {k: v for k, v in d.items() if k in state}\n",
        "    return d\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found"
            "[an-optimizer-whose-scheduler-wrapped-its-step-sent-then-stepped-fork]"
        ],
    ),
    Mutation(
        "an-owner-goes-by-reference-to-stale-memory",
        "enot_nb/_serialize/tensors.py",
        "    owner[...] = value\n    return owner\n\n\ndef array_extent(",
        "    return owner\n\n\ndef array_extent(",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found"
            "[an-owner-written-outside-the-view-that-went-first-fork]"
        ],
    ),
    Mutation(
        "aliases-in-new-values-keep-the-new-plain-items",
        "enot_nb/_state/apply.py",
        "    if not made:\n        return value\n",
        "    if True:\n        return value\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found"
            "[aliases-into-a-large-list-inside-values-the-cell-that-changed-it-made-fork]"
        ],
    ),
    Mutation(
        "a-finished-rank-destroys-its-process-group",
        "enot_nb/_worker/bootstrap.py",
        "    os._exit(exitcode)\n\n\ndef init_kwargs(",
        "    import torch.distributed as dist\n\n    if exitcode == 0 and dist.is_initialized():\n"
        "        dist.destroy_process_group()\n    os._exit(exitcode)\n\n\ndef init_kwargs(",
        ["tests/launcher/test_launcher.py::test_a_rank_leaves_without_destroying_its_process_group"],
    ),
    Mutation(
        "a-quiet-session-cell-is-no-sync",
        "enot_nb/_session/kernel/flow.py",
        "            self.mirror.matched()  # nothing moved either way: the record still holds (and costs nothing)\n",
        "",
        [
            "tests/session/test_session_parity.py::"
            "test_session_cells_after_a_quiet_one_compare_nothing_the_plain_cells_before_it_reached"
        ],
    ),
    Mutation(
        "a-known-view-leaves-its-owner-uncompared",
        "enot_nb/_session/mirror/mirror.py",
        "        return array.base is not None or baseline.find(array) is None\n",
        "        return baseline.find(array) is None\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found"
            "[a-write-through-an-old-view-in-underscore-fork]"
        ],
    ),
    Mutation(
        "a-view-over-a-known-storage-travels-with-its-owner",
        "enot_nb/_serialize/picklers.py",
        "            held = self._memory.storage_holding_view(array, root)\n",
        "            held = None\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found"
            "[a-view-whose-owner-is-gone-shares-the-tensor-over-it-fork]"
        ],
    ),
    Mutation(
        "copyregs-slotnames-cache-a-class-change",
        "enot_nb/_state/states.py",
        '_NOT_THE_CLASS_S = ("__dict__", "__weakref__", "__slotnames__")\n',
        '_NOT_THE_CLASS_S = ("__dict__", "__weakref__")\n',
        ["tests/session/test_session_parity.py::test_the_fuzzers_seeds_stay_found[500077]"],
    ),
    Mutation(
        "tensor-owned-arrays-left-out-of-the-memory-map",
        "enot_nb/_serialize/tensors.py",
        "                memory = contiguous_memory(array)\n",
        "                memory = contiguous_memory(array) if tensor_owned(array) is None else None\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found"
            "[a-tensor-over-an-array-the-ranks-hold-without-its-tensor-fork]"
        ],
    ),
    Mutation(
        "plain-data-walked-as-the-receiver-sees-it",
        "enot_nb/_session/mirror/paths.py",
        "    return Kind.PLAIN if spec.plain and kind in (Kind.LIST, Kind.DICT) else kind\n",
        "    return kind\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found"
            "[a-large-list-the-master-walks-item-by-item-fork]"
        ],
    ),
    Mutation(
        "plain-cells-outside-runs-ignored",
        "enot_nb/_session/kernel/plain_cells.py",
        "        if self.outside() is not None:\n            return None\n",
        "",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[a-thread-writes-between-cells-fork]",
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[a-silent-run-writes-fork]",
        ],
    ),
    Mutation(
        "silent-runs-not-counted",
        "enot_nb/_session/kernel/plain_cells.py",
        "            self.silent_runs += 1\n",
        "            pass\n",
        ["tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[a-silent-run-writes-fork]"],
    ),
    Mutation(
        "comm-messages-not-counted",
        "enot_nb/_session/kernel/plain_cells.py",
        "        self.comms += 1\n",
        "        pass\n",
        ["tests/session/test_session_parity.py::test_a_widgets_callback_between_cells_reaches_the_ranks"],
    ),
    Mutation(
        "thread-starts-not-counted",
        "enot_nb/_session/kernel/plain_cells.py",
        "        if self.started != before.started:\n",
        "        if False:\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[a-thread-started-and-joined-in-a-plain-cell-fork]"
        ],
    ),
    Mutation(
        "thread-cpu-time-not-compared",
        "enot_nb/_session/kernel/plain_cells.py",
        '            if cpu < 0 or before.threads.get(ident, ("", -2))[1] != cpu:\n',
        "            if cpu < 0:\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[a-thread-writes-between-cells-fork]"
        ],
    ),
    Mutation(
        "thread-start-hook-chained-to-itself",
        "enot_nb/_session/kernel/plain_cells.py",
        "        if current != self._hook:",
        "        if current is not self._hook:",
        ["tests/unit/test_plain_cells.py::test_a_second_tracker_leaves_threads_running_and_counted"],
    ),
    Mutation(
        "deleted-names-forgotten",
        "enot_nb/_session/kernel/plain_cells.py",
        "            gone.update(cell.gone)\n",
        "",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[a-name-deleted-after-its-write-fork]"
        ],
    ),
    Mutation(
        "ipython-outputs-not-walked",
        "enot_nb/_session/kernel/plain_cells.py",
        "        registry.extend(sorted(n for n in used if _OUTPUT_NAME.match(n) and n in namespace), namespace)\n",
        "",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[writes-through-ipythons-outputs-fork]"
        ],
    ),
    Mutation(
        "memory-shared-across-kinds-not-compared",
        "enot_nb/_session/mirror/mirror.py",
        "            shared_objects, shared_storages = _sharing_memory(baseline, reached)\n",
        "            shared_objects, shared_storages = set(), set()\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[memory-shared-by-a-tensor-and-its-numpy-array-fork]",
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[a-numpy-view-written-in-a-plain-cell-fork]",
        ],
    ),
    Mutation(
        "storage-over-a-tensors-memory-copied",
        "enot_nb/_serialize/picklers.py",
        "        if within is not None:\n            return tensors._storage_over_storage",
        "        if False:\n            return tensors._storage_over_storage",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[memory-shared-as-the-master-made-it-fork]"
        ],
    ),
    Mutation(
        "view-of-a-known-array-over-its-tensor",
        "enot_nb/_serialize/picklers.py",
        "        if tensor is not None and self.is_known(array, tensors.array_owner(array)) is None:\n",
        "        if tensor is not None:\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[memory-shared-as-the-master-made-it-fork]"
        ],
    ),
    Mutation(
        "an-owner-sent-late-copied",
        "enot_nb/_serialize/picklers.py",
        "        if known_view is not None:  # ",
        "        if False:  # ",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[an-arrays-owner-sent-after-its-view-fork]"
        ],
    ),
    Mutation(
        "plain-data-with-aliases-one-object",
        "enot_nb/_state/kinds.py",
        "    held = _held_from_outside(obj)\n",
        "    held = False\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[aliases-into-a-large-list-of-records-fork]"
        ],
    ),
    Mutation(
        "items-of-plain-data-by-value",
        "enot_nb/_state/collect.py",
        "        item = self._in_plain(obj)\n",
        "        item = None\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[a-large-list-walked-on-one-side-only-fork]"
        ],
    ),
    Mutation(
        "plain-data-applied-by-the-receivers-kind",
        "enot_nb/_state/kinds.py",
        "        if type(state) is list:\n            return Kind.PLAIN\n",
        "",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[a-large-list-walked-on-one-side-only-fork]"
        ],
    ),
    Mutation(
        "a-bound-item-keeps-the-new-copy",
        "enot_nb/_state/apply.py",
        "            namespace[name] = with_old_items(value, made, registry)\n",
        "            namespace[name] = value\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[a-record-bound-beside-its-lists-change-fork]"
        ],
    ),
    Mutation(
        "a-pull-registry-of-the-pulled-names-alone",
        "enot_nb/_session/kernel/flow.py",
        "        if self.mirrored:  # what a pulled value shares",
        "        if False:  # what a pulled value shares",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[a-pulled-optimizer-steps-the-notebooks-model-fork]"
        ],
    ),
    Mutation(
        "no-storage-copy-back",
        "enot_nb/_state/apply.py",
        "    for new in changes.storages:\n",
        "    for new in changes.storages[:0]:\n",
        ["notebooks/01_quickstart.ipynb"],  # its cell that prints the synced weights
    ),
    Mutation(
        "apply-does-nothing",
        "enot_nb/_state/apply.py",
        "        return _apply_all(namespace, registry, changes, returns)\n",
        "        return []\n",
        [
            "tests/cells/test_state_parity.py::test_distributed_cell_is_a_local_cell[resize-notebook-tensor-fork]",
            "tests/cells/test_state_parity.py::test_distributed_cell_is_a_local_cell[module-moved-between-devices-fork]",
        ],
    ),
    Mutation(
        "negative-timeout-accepted",
        "enot_nb/_launch/options.py",
        "math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S",
        "math.isfinite(seconds) and seconds <= MAX_TIMEOUT_S",
        [
            "tests/launcher/test_reliability.py::test_bad_launcher_arguments_fail_fast_and_clearly",
            "tests/launcher/test_reliability.py::test_bad_magic_options_are_usage_errors",
        ],
    ),
    Mutation(
        "no-stop-after-a-failure",
        "enot_nb/_launch/attempt.py",
        "        self.stop([r for r in self.attempt.ranks if r.running], _ESCALATION[1:])\n",
        "        pass\n",
        ["tests/launcher/test_launcher.py::test_other_ranks_are_stopped_by_the_launcher_after_a_failure"],
    ),
    Mutation(
        "results-come-back-as-zeros",
        "enot_nb/_serialize/tensors.py",
        "    storage = torch.UntypedStorage(view.nbytes)\n    if view.nbytes:\n",
        "    storage = torch.UntypedStorage(view.nbytes)\n    storage_array(storage)[:] = 0\n    if False:\n",
        ["tests/launcher/test_hygiene.py::test_kept_results_hold_no_file_descriptor"],
    ),
    Mutation(
        # Half of each small returned storage's bytes arrive (the rest zeros): the weights still
        # "changed", as the old checks asked, but they are not the trained ones.
        "half-of-each-returned-storage",
        "enot_nb/_serialize/tensors.py",
        "        storage_array(storage)[:] = numpy.frombuffer(view, dtype=numpy.uint8)\n",
        "        half = view.nbytes // 2\n"
        "        storage_array(storage)[:] = 0\n"
        "        storage_array(storage)[:half] = numpy.frombuffer(view, dtype=numpy.uint8)[:half]\n",
        [
            "tests/frameworks/test_integrations.py::test_lightning_trainer_ddp_trains_on_the_workers",
            "tests/frameworks/test_integrations.py::test_lightning_fabric_ddp_trains_on_the_workers",
            "tests/frameworks/test_integrations.py::test_hf_trainer_trains_a_model_built_in_the_notebook",
            "tests/frameworks/test_integrations.py::test_accelerate_prepare_backward_gather",
        ],
    ),
    Mutation(
        "apply-not-held-against-stop-presses",
        "enot_nb/_state/apply.py",
        "    with interrupts_deferred():\n        return _apply_all(",
        "    if True:\n        return _apply_all(",
        ["tests/cells/test_reach.py::test_a_stop_press_anywhere_in_applying_the_changes_leaves_all_of_them_or_none"],
    ),
    Mutation(
        # Pages shared with a child the master forked are no longer the master's own: unrecorded,
        # a write made before the fork is lost.
        "pages-at-forks-not-recorded",
        "enot_nb/_memory/forks.py",
        "    def before_fork(self) -> None:\n",
        "    def before_fork(self) -> None:\n        return\n",
        ["tests/cells/test_reach.py::test_a_storage_comes_back_by_its_written_pages_even_with_a_live_child"],
    ),
    Mutation(
        "magic-arguments-not-reached",
        "enot_nb/_state/reach.py",
        "        return _loose_names(arguments[1])\n",
        "        return CodeNames(frozenset())\n",
        [
            "tests/cells/test_state_parity.py::test_distributed_cell_is_a_local_cell[line-magic-argument-reaches-the-model-fork]"
        ],
    ),
    Mutation(
        "forks-do-not-wait-for-the-preload",
        "enot_nb/_worker/preload.py",
        "            thread.join()\n",
        "            pass\n",
        ["tests/cells/test_preload.py::test_a_fork_waits_for_the_background_import"],
    ),
    Mutation(
        "session-push-drops-in-place-changes",
        "enot_nb/_session/mirror/mirror.py",
        "        changes, changed = collect("
        "record.baseline, record.snapshot, record.synced, namespace, hidden, within)\n",
        "        changes, changed = Changes(), []\n",
        [
            "tests/session/test_mirror.py::test_a_plain_change_in_place_reaches_every_rank",
            "tests/session/test_session_parity.py::test_a_session_cell_is_a_local_cell"
            "[model-trained-in-place-lr-changed-in-a-plain-cell-fork]",
        ],
    ),
    Mutation(
        "session-abort-leaves-peer-sockets-open",
        "enot_nb/_session/worker/groups.py",
        "    for fd in sockets.connections_to(others):\n",
        "    for fd in sockets.connections_to(()):\n",
        ["tests/session/test_faults.py::test_a_rank_blocked_in_a_collective_is_released_and_the_group_made_again"],
    ),
    Mutation(
        "session-widgets-under-the-first-cell",
        "enot_nb/_session/worker/loop.py",
        "                frontend.follow_parent(parent)\n",
        "                pass\n",
        ["tests/session/test_session_parity.py::test_widgets_and_output_captures_hang_under_the_cell_that_runs"],
    ),
    Mutation(
        "session-no-shadow-fork",
        "enot_nb/_memory/shadow.py",
        "        if self.pid is None or owned_share > RENEW_ABOVE:\n",
        "        if False:\n",
        ["tests/session/test_mirror.py::test_one_element_written_into_a_large_tensor_sends_a_page"],
    ),
    Mutation(
        "session-kept-snapshot-not-dropped",
        "enot_nb/_session/worker/loop.py",
        "    if not keep:  # before anything changes: a push, another task (see KeptSnapshot)\n        _KEPT.drop()\n",
        "    if not keep:  # before anything changes: a push, another task (see KeptSnapshot)\n        pass\n",
        [
            "tests/session/test_kept_walks.py::test_the_master_keeps_its_snapshot_from_cell_to_cell_and_still_sees_every_write"
        ],
    ),
    Mutation(
        "session-kept-snapshot-not-retaken",
        "enot_nb/_session/mirror/kept.py",
        "            snapshot.retake(registry, objects, storages, scan_large=True)\n",
        "            pass\n",
        [
            "tests/session/test_kept_walks.py::test_the_master_keeps_its_snapshot_from_cell_to_cell_and_still_sees_every_write"
        ],
    ),
    Mutation(
        "session-kept-reach-bindings-unchecked",
        "enot_nb/_session/kernel/cell_reach.py",
        "            and reach.bound_as_looked_up(self.found, namespace, hidden)\n",
        "",
        ["tests/session/test_kept_walks.py::test_a_reach_kept_from_the_last_cell_is_what_a_fresh_walk_gives"],
    ),
    Mutation(
        "session-kept-reach-changes-unchecked",
        "enot_nb/_session/kernel/cell_reach.py",
        "            and not any(registry.find(obj) is not None for obj in since.moved.objects)\n",
        "",
        ["tests/session/test_kept_walks.py::test_a_reach_kept_from_the_last_cell_is_what_a_fresh_walk_gives"],
    ),
    Mutation(
        "session-master-kept-registry-roots-unchecked",
        "enot_nb/_session/mirror/kept.py",
        "            if parent == 0 and namespace.get(step, _NONE) is not registry.objects[i]:\n",
        "            if False:\n",
        ["tests/session/test_kept_walks.py::test_a_reach_kept_from_the_last_cell_is_what_a_fresh_walk_gives"],
    ),
    Mutation(
        "session-master-kept-registry-after-a-move",
        "enot_nb/_session/mirror/kept.py",
        "        if again is not None and not has_placeholders(registry) and not snapshot.untaken(registry):\n",
        "        if not has_placeholders(registry) and not snapshot.untaken(registry):\n",
        [
            "tests/session/test_kept_walks.py::test_a_kept_registry_is_found_by_its_specs_only_where_the_cell_changes_were_found_again"
        ],
    ),
    Mutation(
        "found-again-on-another-storage",
        "enot_nb/_session/mirror/paths.py",
        "                return None  # on another storage now (``t.data = other``)\n",
        "                pass\n",
        [
            "tests/session/test_kept_walks.py::test_the_objects_a_cell_changed_found_again_are_what_a_fresh_find_gives",
            "tests/session/test_kept_walks.py::test_a_kept_registry_is_found_by_its_specs_only_where_the_cell_changes_were_found_again",
        ],
    ),
    Mutation(
        "found-again-rank-sharing-unchecked",
        "enot_nb/_session/mirror/paths.py",
        "    if moves and not _as_specified(registry, specs):  # (where nothing moves, it is as registry_at left it)\n",
        "    if False:\n",
        ["tests/session/test_kept_walks.py::test_the_objects_a_cell_changed_found_again_are_what_a_fresh_find_gives"],
    ),
    Mutation(
        "kept-reach-walk-order-unchecked",
        "enot_nb/_session/mirror/record.py",
        "    if regrowth is None or not regrowth.in_walk_order:\n",
        "    if regrowth is None:\n",
        [
            "tests/session/test_kept_walks.py::test_a_reach_kept_after_a_cell_that_reorders_or_aliases_is_what_a_fresh_walk_gives"
        ],
    ),
    Mutation(
        "session-sharded-module-made-plain-after-a-failure",
        "enot_nb/_worker/cell.py",
        "            if options.gather_sharded\n",
        "            if True\n",
        [
            "tests/session/test_sharded.py::test_a_module_sharded_by_fsdp2_stays_sharded_on_the_ranks_and_plain_in_the_notebook"
        ],
    ),
    Mutation(
        "session-sharded-module-sent-back",
        "enot_nb/_worker/cell.py",
        "            if not options.gather_sharded and sharded.may_be_sharded()\n",
        "            if False\n",
        [
            "tests/session/test_sharded.py::test_a_module_sharded_by_fsdp2_stays_sharded_on_the_ranks_and_plain_in_the_notebook"
        ],
    ),
    Mutation(
        "pull-sends-placeholder-storages",
        "enot_nb/_state/collect.py",
        "        j for j, s in enumerate(registry.storages[:storages]) if s is not None and "
        "registry.find_storage(s) == j\n",
        "        j for j, s in enumerate(registry.storages[:storages]) if s is not None\n",
        [
            "tests/session/test_mirror.py::test_a_pull_of_what_the_master_holds_as_another_type_leaves_the_notebooks_storages_whole"
        ],
    ),
    Mutation(
        "session-launch-makes-a-live-sharded-module-whole",
        "enot_nb/_session/worker/loop.py",
        "    return value, tracker.outcome(options, None, False, None, None)\n",
        "    return sharded.whole_result(value), tracker.outcome(options, None, False, None, None)\n",
        [
            "tests/session/test_sharded.py::test_a_launched_function_that_returns_a_live_sharded_module_leaves_it_sharded"
        ],
    ),
    Mutation(
        "found-again-shared-storage",
        "enot_nb/_session/mirror/paths.py",
        "        if any(users[j] != 1 for j in spec.storages if j >= 0):\n",
        "        if False:\n",
        ["tests/session/test_kept_walks.py::test_the_objects_a_cell_changed_found_again_are_what_a_fresh_find_gives"],
    ),
    Mutation(
        "session-popped-object-changes-dropped",
        "enot_nb/_session/mirror/mirror.py",
        "            held = sorted(n for n in now if n in synced or n in reached)\n",
        "            held = sorted(n for n in now if n in synced)\n",
        [
            "tests/session/test_mirror.py::test_an_object_taken_out_of_a_synced_one_into_a_new_variable_keeps_its_changes"
        ],
    ),
    Mutation(
        "shared-memory-storage-write-tracked",
        "enot_nb/_memory/digests.py",
        "    shared = [scan_large and not _is_array(owner) and _shared(owner) for owner in owners]\n",
        "    shared = [False] * len(areas)\n",
        ["tests/unit/test_written_pages.py::test_storages_whose_writes_are_not_told_are_digested_whole"],
    ),
    Mutation(
        "write-tracker-registrations-uncapped",
        "enot_nb/_memory/writes.py",
        "            if self._registered >= MAX_REGISTRATIONS:\n",
        "            if False:\n",
        ["tests/unit/test_written_pages.py::test_storages_whose_writes_are_not_told_are_digested_whole"],
    ),
    Mutation(
        "late-presses-not-ignored",
        "enot_nb/_worker/cell.py",
        "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n",
        "    signal.signal(signal.SIGINT, signal.getsignal(signal.SIGINT))\n",
        [
            "tests/session/test_presses.py::test_a_press_while_the_master_makes_its_outcome_is_late_and_the_outcome_comes_whole",
            "tests/session/test_presses.py::test_the_stop_button_while_the_master_makes_its_outcome_still_brings_it_whole",
        ],
    ),
    Mutation(
        "carried-over-states-of-moved-objects",
        "enot_nb/_state/snapshot.py",
        "            same = i is not None and before.kinds[i] is kind and id(obj) not in moved_ids\n",
        "            same = i is not None and before.kinds[i] is kind\n",
        ["tests/session/test_mirror.py::test_new_grads_every_step_leave_records_that_match_what_they_record"],
    ),
    Mutation(
        "carried-over-digests-of-written-storages",
        "enot_nb/_state/snapshot.py",
        "        at = [None if id(s) in written_ids else before.find_storage(s) for s in registry.storages]\n",
        "        at = [before.find_storage(s) for s in registry.storages]\n",
        ["tests/session/test_mirror.py::test_new_grads_every_step_leave_records_that_match_what_they_record"],
    ),
    Mutation(
        "session-written-pages-untold",  # (a mutation inside writes.py fails its probe: no tracking)
        "enot_nb/_memory/written.py",
        "            found[j] = WRITES.written(areas[j], epoch)\n",
        "            found[j] = None\n",
        ["tests/session/test_mirror.py::test_one_element_written_into_a_large_tensor_sends_a_page"],
    ),
    Mutation(
        "session-no-repair-after-a-fault",
        "enot_nb/_session/kernel/workers.py",
        "            self._repair()\n",
        "            pass\n",
        ["tests/session/test_work_kept.py::test_an_exception_on_one_rank_mid_epoch_leaves_ddp_and_opt_training[fork]"],
    ),
    Mutation(
        "session-replicas-left-unequal",
        "enot_nb/_session/worker/repair.py",
        "    equalized = equalize(replication.replicas)  # every rank, whatever it holds: a collective\n",
        "    equalized = Equalized([], [], 0)\n",
        ["tests/session/test_work_kept.py::test_an_exception_on_one_rank_mid_epoch_leaves_ddp_and_opt_training[fork]"],
    ),
    Mutation(
        # The walk over the rank's variables skipped though the process holds DDP wrappers.
        "repair-walk-skipped-while-ddp-is-held",
        "enot_nb/_session/worker/repair.py",
        "    held = reach(namespace, None if lost else found)\n",
        "    held = reach(namespace, None if lost else [])\n",
        [
            "tests/session/test_work_kept.py::test_a_ddp_wrapper_in_a_dict_is_compared_and_made_equal_after_a_failed_cell[fork]"
        ],
    ),
    Mutation(
        # The walk ends at the first object it looks for (``opt``), before ``nets['G']``.
        "repair-walk-ends-at-the-first-found",
        "enot_nb/_worker/held.py",
        "            if not self.left:\n                raise _AllFound\n",
        "            raise _AllFound\n",
        [
            "tests/session/test_work_kept.py::test_a_ddp_wrapper_in_a_dict_is_compared_and_made_equal_after_a_failed_cell[fork]"
        ],
    ),
    Mutation(
        "repair-fsdp-guarded-only-in-variables",
        "enot_nb/_session/worker/repair.py",
        "        if isinstance(obj, sharded_type) and not reached_through(held, i, (sharded_type,)):\n",
        "        if isinstance(obj, sharded_type) and held.parents[i][0] == 0:\n",
        ["tests/session/test_sharded.py::test_an_fsdp2_module_held_in_a_dict_is_guarded_by_its_path"],
    ),
    Mutation(
        # A guarded FSDP module named a second time, as sharded state to reload.
        "repair-guarded-fsdp-named-twice",
        "enot_nb/_session/worker/repair.py",
        "    unsure = [str(s) for s in replication.sharded if s.where not in guarded]",
        "    unsure = [str(s) for s in replication.sharded]",
        ["tests/session/test_sharded.py::test_an_fsdp2_module_held_in_a_dict_is_guarded_by_its_path"],
    ),
    Mutation(
        # Nothing tracked: no wrapper is rebound (and the walk finds nothing to look for).
        "repair-no-wrapper-tracked",
        "enot_nb/_worker/held.py",
        "    return [o for o in objects if type(o) in hits and _live(o)] if hits else []\n",
        "    return []\n",
        [
            "tests/session/test_work_kept.py::test_an_error_mid_backward_on_every_rank_keeps_the_group_and_resets_the_reducer"
        ],
    ),
    Mutation(
        # A wrapper on the world group that was made again is taken for one on a lost subgroup.
        "repair-wrapper-on-the-old-world-left",
        "enot_nb/_session/worker/repair.py",
        "    return world if spanned_the_world else None\n",
        "    return None\n",
        ["tests/session/test_work_kept.py::test_an_exception_on_one_rank_mid_epoch_leaves_ddp_and_opt_training[fork]"],
    ),
    Mutation(
        # A DDP wrapper's own process_group named as a place the user's subgroup was put back.
        "repair-torch-holders-named",
        "enot_nb/_session/worker/repair.py",
        '.startswith("torch."):\n',
        '.startswith("no such module."):\n',
        [
            "tests/session/test_faults.py::test_a_subgroup_held_in_a_dict_and_a_nested_list_is_made_again_where_it_was[fork]"
        ],
    ),
    Mutation(
        # ZeRO left on the world group that was made again: its next step fails.
        "repair-zero-left-on-the-old-group",
        "enot_nb/_session/worker/repair.py",
        "            zero.process_group = group\n",
        "            pass\n",
        ["tests/session/test_work_kept.py::test_zeros_shards_are_left_as_each_rank_holds_them[fork]"],
    ),
    Mutation(
        # A wrapper a dict holds (``nets['G']``) is rebound but never compared.
        "repair-ddp-replicas-only-in-variables",
        "enot_nb/_worker/replicas.py",
        "        if isinstance(obj, sharded_types.ddp):\n",
        "        if isinstance(obj, sharded_types.ddp) and held.parents[i][0] == 0:\n",
        [
            "tests/session/test_work_kept.py::test_a_ddp_wrapper_in_a_dict_is_compared_and_made_equal_after_a_failed_cell[fork]"
        ],
    ),
    Mutation(
        "repair-ddp-buffers-not-compared",
        "enot_nb/_worker/replicas.py",
        "(*ddp.module.named_parameters(), *ddp.module.named_buffers())",
        "(*ddp.module.named_parameters(),)",
        [
            "tests/session/test_work_kept.py::test_a_ddp_wrapper_in_a_dict_is_compared_and_made_equal_after_a_failed_cell[fork]"
        ],
    ),
    Mutation(
        "repair-optimizer-state-not-compared",
        "enot_nb/_worker/replicas.py",
        "            if isinstance(value, torch.Tensor) and not _is_dtensor(value):\n",
        "            if False:\n",
        [
            "tests/session/test_work_kept.py::test_a_ddp_wrapper_in_a_dict_is_compared_and_made_equal_after_a_failed_cell[fork]"
        ],
    ),
    Mutation(
        # ZeRO's per-rank inner optimizer taken for a replica: its keys differ on the ranks, so
        # it is named as held differently, though the cell left it consistent.
        "repair-zero-inner-optimizer-a-replica",
        "enot_nb/_worker/replicas.py",
        '            inner.add(id(getattr(obj, "optim", None)))\n',
        "            pass\n",
        ["tests/session/test_work_kept.py::test_zeros_shards_are_left_as_each_rank_holds_them[fork]"],
    ),
    Mutation(
        # Keys not compared across ranks: each rank takes its replicas by rank 0's keys, which
        # a hand-made sharded optimizer's state does not match.
        "repair-keys-not-compared-across-ranks",
        "enot_nb/_worker/replicas.py",
        "        everywhere = torch.tensor([k in by_key for k in keys.tolist()], dtype=torch.int64, device=device)\n",
        "        everywhere = torch.ones(len(keys), dtype=torch.int64, device=device)\n",
        [
            "tests/session/test_work_kept.py::test_an_optimizer_over_other_ddp_parameters_on_each_rank_is_named_not_overwritten[fork]"
        ],
    ),
    Mutation(
        "repair-replicas-held-apart-not-named",
        "enot_nb/_session/worker/repair.py",
        "    if done.apart or done.apart_elsewhere:\n",
        "    if False:\n",
        [
            "tests/session/test_work_kept.py::test_an_optimizer_over_other_ddp_parameters_on_each_rank_is_named_not_overwritten[fork]"
        ],
    ),
    Mutation(
        "repair-sharded-state-never-named",
        "enot_nb/_session/worker/repair.py",
        "    if unsure and (destroyed or",
        "    if False and (destroyed or",
        ["tests/session/test_work_kept.py::test_zeros_shards_are_left_as_each_rank_holds_them[fork]"],
    ),
    Mutation(
        "repair-subgroup-in-a-dict-not-put-back",
        "enot_nb/_session/worker/repair.py",
        "    if kind is Kind.DICT:\n",
        "    if False:\n",
        [
            "tests/session/test_faults.py::test_a_subgroup_held_in_a_dict_and_a_nested_list_is_made_again_where_it_was[fork]"
        ],
    ),
    Mutation(
        "repair-names-by-type-only",
        "enot_nb/_session/worker/repair.py",
        '    return held.path(i) if i is not None else f"a {type(obj).__name__}"\n',
        '    return f"a {type(obj).__name__}"\n',
        [
            "tests/session/test_work_kept.py::test_a_ddp_wrapper_in_a_dict_is_compared_and_made_equal_after_a_failed_cell[fork]"
        ],
    ),
    Mutation(
        # The reducer left expecting the rest of a backward that every rank cut short, on a
        # group that was kept: its next forward fails.
        "repair-reducer-not-reset-on-a-kept-group",
        "enot_nb/_session/worker/repair.py",
        "        ddp._update_process_group(group)  # the reducer reset too\n",
        "        if group is not ddp.process_group:\n            ddp._update_process_group(group)\n",
        [
            "tests/session/test_work_kept.py::test_an_error_mid_backward_on_every_rank_keeps_the_group_and_resets_the_reducer"
        ],
    ),
    Mutation(
        "session-idle-deaths-unseen",
        "enot_nb/_session/kernel/workers.py",
        "        self.host.poll(0)\n        ranks = self.host.ranks\n",
        "        ranks = self.host.ranks\n",
        [
            "tests/session/test_work_kept.py::test_a_rank_that_died_while_idle_makes_the_next_cell_restart_the_session_first"
        ],
    ),
    Mutation(
        "session-table-misses-idle-deaths",
        "enot_nb/_session/kernel/status.py",
        "    workers.host.poll(0)  # a rank that died since its last task shows as dead\n",
        "",
        ["tests/session/test_work_kept.py::test_a_rank_that_dies_while_idle_shows_as_dead_in_the_table"],
    ),
    Mutation(
        "session-masters-state-lost-with-a-dead-peer",
        "enot_nb/_session/kernel/workers.py",
        "                self._save_the_masters_state()\n",
        "",
        ["tests/session/test_work_kept.py::test_a_peer_killed_mid_cell_keeps_the_masters_progress[fork]"],
    ),
    Mutation(
        "session-pushes-its-own-session",
        "enot_nb/_session/mirror/mirror.py",
        "            if kept is None and stays_in_the_kernel(value):\n",
        "            if kept is None and False:\n",
        [
            "tests/session/test_mirror.py::test_a_session_in_the_namespace_is_never_pushed_and_tasks_that_read_every_name_run"
        ],
    ),
    Mutation(
        "session-push-fails-on-an-unpicklable-name",
        "enot_nb/_session/mirror/mirror.py",
        "            if not kept:\n                raise\n",
        "            raise\n",
        [
            "tests/session/test_mirror.py::test_a_variable_that_cannot_be_pickled_stays_in_the_notebook_and_the_cell_runs"
        ],
    ),
    Mutation(
        "session-rank-only-wrapper-hides-the-model",
        "enot_nb/_session/kernel/cell_reach.py",
        "        if through and found.whole is None and set(synced) - set(found.names):\n",
        "        if False:\n",
        [
            "tests/session/test_session_parity.py::test_a_session_cell_is_a_local_cell["
            "ddp-built-once-then-trained-and-evaluated-through-the-wrapper-alone-fork]"
        ],
    ),
    Mutation(
        "shipped-code-named-dynamic-code",
        "enot_nb/_serialize/picklers.py",
        "            types.CodeType: self._reduce_code,\n",
        "",
        [
            "tests/session/test_session_parity.py::test_a_session_cells_traceback_names_the_notebook_cell_and_line",
            "tests/cells/test_kernel.py::test_a_spawn_cells_traceback_names_the_notebook_cell_and_line",
        ],
    ),
    Mutation(
        "worker-traceback-by-cell-file",
        "enot_nb/_launch/attempt.py",
        "        info = info._replace(traceback=as_in_the_notebook(info.traceback))\n",
        "",
        ["tests/cells/test_kernel.py::test_a_spawn_cells_traceback_names_the_notebook_cell_and_line"],
    ),
    Mutation(
        "every-sigkill-blamed-on-memory",
        "enot_nb/_launch/attempt.py",
        "                r.signal_cause, self.oom_kills = sigkill_cause(self.oom_kills, counted), counted\n",
        "                pass\n",
        ["tests/launcher/test_launcher.py::test_a_sigkill_names_the_oom_killer_only_where_the_kernel_counted_one"],
    ),
    Mutation(
        "stop-report-shows-every-library-frame",
        "enot_nb/_launch/attempt.py",
        "        elif not reached_user and library_shown < LIBRARY_FRAMES_SHOWN:\n",
        "        elif True:\n",
        ["tests/unit/test_attempt.py::test_a_stop_report_keeps_the_users_frames_and_the_innermost_library_ones"],
    ),
    Mutation(
        "ranks-bars-share-a-line",
        "enot_nb/_launch/output.py",
        "        if owner is not None and owner is not self:\n",
        "        if False:\n",
        ["tests/unit/test_output.py::test_two_ranks_bars_never_share_a_line"],
    ),
    Mutation(
        "session-subgroups-lost-after-a-regroup",
        "enot_nb/_session/worker/repair.py",
        "    remade = _remade(lost, held)\n",
        "    remade = _Remade({}, [])\n",
        ["tests/session/test_faults.py::test_a_half_done_collective_on_a_subgroup_makes_the_groups_again"],
    ),
    Mutation(
        "session-fsdp-after-a-regroup-unguarded",
        "enot_nb/_session/worker/repair.py",
        "    guarded = _guard_sharded(held) if destroyed else []\n",
        "    guarded = []\n",
        [
            "tests/session/test_sharded.py::test_an_fsdp2_module_after_the_groups_were_made_again_says_how_to_shard_it_again"
        ],
    ),
    Mutation(
        "every-plain-cell-waits-for-the-background-import",
        "enot_nb/_worker/preload.py",
        "        return tops is None or bool(tops & self.importing)\n",
        "        return True\n",
        ["tests/cells/test_preload.py::test_only_a_cell_that_imports_what_is_being_imported_waits_for_it"],
    ),
    Mutation(
        "session-graph-going-out-unnamed",
        "enot_nb/_session/mirror/mirror.py",
        "        return Push(None if empty else changes, names, newly_kept, _with_a_graph(changes.bound), settles)\n",
        "        return Push(None if empty else changes, names, newly_kept, [], settles)\n",
        ["tests/session/test_mirror.py::test_a_tensor_with_a_graph_going_out_is_named_as_one_coming_back_is"],
    ),
    Mutation(
        "session-rebound-storage-wedges",
        "enot_nb/_session/mirror/paths.py",
        "        if len(here) != len(spec.sizes) or any(n >= 0 and n != m for n, m in zip(spec.sizes, here)):\n",
        "        if here != spec.sizes:\n",
        [
            "tests/session/test_session_parity.py::test_a_session_cell_is_a_local_cell["
            "storages-rebound-in-plain-cells-reach-the-ranks-fork]"
        ],
    ),
    Mutation(
        "no-return-marks-every-read-name-stale",
        "enot_nb/_worker/cell.py",
        "            outcome.left_out = sorted({*outcome.changed_names, *written, *changes.deleted})\n",
        "            outcome.left_out = sorted(set(self.names_before) | set(changes.bound))\n",
        ["tests/session/test_mirror.py::test_reads_never_make_a_name_stale"],
    ),
    Mutation(
        "return-marks-in-place-changes-stale",
        "enot_nb/_worker/cell.py",
        "            outcome.left_out = sorted({*changes.bound, *changes.deleted} - set(options.returns))\n",
        "            outcome.left_out = sorted({*outcome.changed_names, *changes.deleted} - set(options.returns))\n",
        ["tests/session/test_mirror.py::test_reads_never_make_a_name_stale"],
    ),
    Mutation(
        "a-pull-drops-a-stale-change-silently",
        "enot_nb/_session/mirror/mirror.py",
        "            if name in pulling and not overwrite:\n",
        "            if name in pulling and not overwrite and False:\n",
        ["tests/session/test_mirror.py::test_a_stale_variable_changed_here_asks_which_side_wins"],
    ),
    Mutation(
        "a-conflict-refuses-pulls-of-other-names",
        "enot_nb/_session/mirror/mirror.py",
        "            if not pulling and not keeping:\n                raise StaleError",
        "            if True:\n                raise StaleError",
        [
            "tests/session/test_mirror.py::test_a_pull_of_another_name_is_never_refused_by_a_stale_one_and_the_conflict_stays"
        ],
    ),
    Mutation(
        "a-conflict-forgotten-after-a-pull",
        "enot_nb/_session/mirror/mirror.py",
        "        changed_stale |= self.conflicts & set(self.stale)\n",
        "",
        [
            "tests/session/test_mirror.py::test_a_pull_of_another_name_is_never_refused_by_a_stale_one_and_the_conflict_stays"
        ],
    ),
    Mutation(
        "keep-notebook-sends-nothing-whole",
        "enot_nb/_session/kernel/flow.py",
        "        changes.objects = list({**dict(changes.objects), **dict(whole.objects)}.items())\n",
        "",
        [
            "tests/session/test_mirror.py::test_a_pull_of_another_name_is_never_refused_by_a_stale_one_and_the_conflict_stays"
        ],
    ),
    Mutation(
        "a-refused-push-is-retried-forever",
        "enot_nb/_session/kernel/flow.py",
        "        if outcome.refused:\n            self._push_refused(push, outcome)\n",
        "        if outcome.refused:\n",
        [
            "tests/session/test_mirror.py::test_a_push_a_rank_refuses_marks_the_variable_stale_once_and_the_next_cell_runs"
        ],
    ),
    Mutation(
        "an-array-over-a-ranks-storage-travels-as-a-copy",
        "enot_nb/_state/collect.py",
        "        return list(self.registry.storages)\n",
        "        return []\n",
        [
            "tests/session/test_mirror.py::test_an_array_and_a_tensor_sharing_memory_share_it_on_the_ranks_whichever_reaches_them_first"
        ],
    ),
    Mutation(
        "set-items-registered-before-their-own-paths",
        "enot_nb/_state/registry.py",
        "                if step.startswith(SET_ITEM):\n",
        "                if False:\n",
        [
            "tests/unit/test_changes.py::"
            "test_a_sets_item_is_registered_by_its_path_elsewhere_and_steps_follow_what_items_hold"
        ],
    ),
    Mutation(
        "set-items-matched-by-iteration-order",
        "enot_nb/_state/kinds.py",
        "    return [(_item_step(v), v) for v in list(obj)] + _attribute_steps(obj)\n",
        '    return [(f"{SET_ITEM} {i}>", v) for i, v in enumerate(list(obj))] + _attribute_steps(obj)\n',
        ["tests/session/test_mirror.py::test_set_items_are_never_matched_by_iteration_order"],
    ),
    Mutation(
        "frozensets-walked-as-tuples",
        "enot_nb/_state/kinds.py",
        "    return _set_children(obj) if isinstance(obj, frozenset) else _indexed_children(obj)\n",
        "    return _indexed_children(obj)\n",
        ["tests/session/test_mirror.py::test_set_items_are_never_matched_by_iteration_order"],
    ),
    Mutation(
        "plain-changes-to-a-pulled-sharded-module-pushed-as-any",
        "enot_nb/_session/mirror/mirror.py",
        "        changes.sharded = self._sharded_loads(namespace, changes, left_out)\n",
        "",
        ["tests/session/test_sharded.py::test_a_pulled_fsdp2_module_takes_plain_changes_onto_the_ranks_sharded_one"],
    ),
    Mutation(
        "fsdp-subclass-is-another-type-at-its-path",
        "enot_nb/_session/mirror/paths.py",
        "    if type_name(obj) != spec.type_name and not _sharded_of(obj, spec.type_name):\n",
        "    if type_name(obj) != spec.type_name:\n",
        ["tests/session/test_sharded.py::test_a_pulled_fsdp2_module_takes_plain_changes_onto_the_ranks_sharded_one"],
    ),
    Mutation(
        "a-sharded-module-loads-no-values",
        "enot_nb/_worker/sharded.py",
        "        set_model_state_dict(module, values, options=StateDictOptions(full_state_dict=True))\n",
        "        pass\n",
        ["tests/session/test_sharded.py::test_a_pulled_fsdp2_module_takes_plain_changes_onto_the_ranks_sharded_one"],
    ),
    Mutation(
        "a-cell-apart-from-a-sharded-module-marks-it-stale",
        "enot_nb/_worker/sharded.py",
        "    return dict.fromkeys(sorted(moved), SHARDED_ON_THE_RANKS)",
        "    return dict.fromkeys(sorted(names), SHARDED_ON_THE_RANKS)",
        [
            "tests/session/test_sharded.py::"
            "test_a_cell_that_leaves_a_sharded_module_alone_leaves_the_pulled_copy_current"
        ],
    ),
    Mutation(
        "spawn-keeps-copies-a-holder-rebuilt",
        "enot_nb/cells.py",
        "(values, left_out, objects, code, options, registry.parents)",
        "(values, left_out, objects, code, options)",
        [
            "tests/cells/test_state_parity_objects.py::"
            "test_distributed_cell_is_a_local_cell[a-sub-object-its-holders-setstate-builds-spawn]"
        ],
    ),
    Mutation(
        # The holder's __setstate__ made the new sub-object empty: without the copy's state it
        # loses what the notebook's held before the cell (only the cell's change comes back).
        "spawn-rebuilt-sub-object-without-the-notebooks-state",
        "enot_nb/_state/registry.py",
        "            apply(new, state, lambda _: None)\n",
        "            pass\n",
        [
            "tests/cells/test_state_parity_objects.py::test_distributed_cell_is_a_local_cell"
            "[a-sub-object-its-holders-setstate-rebuilds-without-its-state-spawn]"
        ],
    ),
    Mutation(
        "workers-namespace-not-main",
        "enot_nb/_worker/cell.py",
        "    main.__dict__ = namespace\n",
        "    return\n",
        [
            "tests/session/test_session_parity.py::test_a_session_cell_is_a_local_cell"
            "[a-dataclass-defined-in-a-session-cell-over-a-notebook-class-fork]",
            "tests/session/test_session_parity.py::test_a_session_cell_is_a_local_cell"
            "[a-dataclass-defined-in-a-session-cell-over-a-notebook-class-spawn]",
            "tests/cells/test_state_parity_objects.py::test_distributed_cell_is_a_local_cell"
            "[a-dataclass-over-a-notebook-class-defined-in-the-cell-spawn]",
        ],
    ),
    Mutation(
        "cells-compiled-with-enot-nbs-future-annotations",
        "enot_nb/_worker/cell.py",
        "flags=options.future_flags, dont_inherit=True)",
        "flags=options.future_flags, dont_inherit=False)",
        [
            "tests/cells/test_state_parity_objects.py::test_distributed_cell_is_a_local_cell"
            "[a-dataclass-over-a-notebook-class-defined-in-the-cell-fork]"
        ],
    ),
    Mutation(
        "session-cells-compiled-without-the-notebooks-future-imports",
        "enot_nb/_session/kernel/flow.py",
        "        future_flags=run.future_flags,\n",
        "",
        ["tests/session/test_session_parity.py::test_a_future_import_in_the_notebook_holds_in_session_cells"],
    ),
    Mutation(
        "one-off-cells-compiled-without-the-notebooks-future-imports",
        "enot_nb/cells.py",
        "        future_flags=_cell.notebook_future_flags(shell),\n",
        "",
        [
            "tests/cells/test_state_parity_objects.py::test_a_future_import_in_the_notebook_holds_in_its_distributed_cells"
        ],
    ),
    Mutation(
        "plain-cells-reach-nothing",
        "enot_nb/_session/kernel/plain_cells.py",
        "            used |= names.names\n",
        "            used |= {n for n in names.names if _OUTPUT_NAME.match(n)}\n",
        [
            "tests/unit/test_plain_cells.py::test_only_what_the_plain_cells_reach_is_compared",
            "tests/session/test_session_parity.py::test_what_plain_cells_change_through_a_function_reaches_the_ranks",
        ],
    ),
    Mutation(
        "a-cell-that-ran-a-task-drops-out-at-its-sync",
        "enot_nb/_session/kernel/plain_cells.py",
        "                cell.ended = self.synced_at()\n",
        "                cell.ended = -1\n",
        [
            "tests/unit/test_plain_cells.py::test_a_cell_that_ran_a_session_task_counts_after_its_sync",
            "tests/session/test_session_parity.py::"
            "test_a_plain_cell_that_runs_a_session_task_then_changes_state_is_pushed",
        ],
    ),
    Mutation(
        "a-placeholder-object-per-slot",
        "enot_nb/_session/mirror/paths.py",
        "    registry.objects = [_MISSING] * objects",
        "    registry.objects = [_Missing() for _ in range(objects)]",
        ["tests/unit/test_session.py::test_a_ranks_registry_holds_one_placeholder_for_all_it_lacks"],
    ),
    Mutation(
        "plain-data-replaced-not-changed-in-place",
        "enot_nb/_state/kinds.py",
        "        kept = [_into(a, b, depth - 1, done, made) for a, b in zip(old, new)]\n",
        "        kept = list(new[: len(old)])\n",
        ["tests/session/test_mirror.py::test_a_large_log_of_plain_records_is_one_object_changed_in_place_both_ways"],
    ),
    Mutation(
        "a-large-log-of-dicts-walked-dict-by-dict",
        "enot_nb/_state/kinds.py",
        "        if t in _PLAIN_CONTAINERS and holds_plain_data(obj):\n",
        "        if False:\n",
        ["tests/session/test_mirror.py::test_a_large_log_of_plain_records_is_one_object_changed_in_place_both_ways"],
    ),
    Mutation(
        "ray-local-rank-is-the-global-rank",
        "enot_nb/_launch/ray_layout.py",
        "                local_rank=mates.index(landing),\n",
        "                local_rank=rank,\n",
        [
            "tests/unit/test_ray_layout.py::test_an_uneven_placement_numbers_ranks_node_by_node",
            "tests/ray_engine/test_ray_session.py::test_ranks_on_two_nodes_train_ddp_as_a_local_session_does",
        ],
    ),
    Mutation(
        # Ray's node ids sort in no order of placement: the node of bundle 0 must be node 0.
        "ray-ranks-follow-sorted-node-ids",
        "enot_nb/_launch/ray_layout.py",
        "    ordered = [landing for node in nodes for landing in by_bundle if landing.node_id == node]\n",
        "    nodes.sort()\n"
        + "    ordered = [landing for node in nodes for landing in by_bundle if landing.node_id == node]\n",
        [
            "tests/unit/test_ray_layout.py::test_node_ids_that_sort_against_placement_number_ranks_by_placement",
        ],
    ),
    Mutation(
        # The actors answer in any order; ranks follow the bundles.
        "ray-ranks-in-answer-order",
        "enot_nb/_launch/ray_layout.py",
        "    by_bundle = sorted(landings, key=lambda landing: landing.bundle)\n",
        "    by_bundle = list(landings)\n",
        [
            "tests/unit/test_ray_layout.py::test_node_ids_that_sort_against_placement_number_ranks_by_placement",
        ],
    ),
    Mutation(
        "ray-local-world-size-is-the-world",
        "enot_nb/_launch/ray_layout.py",
        "                local_world_size=len(mates),\n",
        "                local_world_size=len(ordered),\n",
        [
            "tests/unit/test_ray_layout.py::test_node_ids_that_sort_against_placement_number_ranks_by_placement",
            "tests/unit/test_ray_layout.py::test_an_uneven_placement_numbers_ranks_node_by_node",
        ],
    ),
    Mutation(
        "ray-node-rank-is-the-rank",
        "enot_nb/_launch/ray_layout.py",
        "                node_rank=nodes.index(landing.node_id),\n",
        "                node_rank=rank,\n",
        [
            "tests/unit/test_ray_layout.py::test_node_ids_that_sort_against_placement_number_ranks_by_placement",
            "tests/unit/test_ray_layout.py::test_an_uneven_placement_numbers_ranks_node_by_node",
        ],
    ),
    Mutation(
        "ray-nnodes-is-the-world",
        "enot_nb/_launch/ray_layout.py",
        "                nnodes=len(nodes),\n",
        "                nnodes=len(ordered),\n",
        [
            "tests/unit/test_ray_layout.py::test_node_ids_that_sort_against_placement_number_ranks_by_placement",
            "tests/unit/test_ray_layout.py::test_an_uneven_placement_numbers_ranks_node_by_node",
        ],
    ),
    Mutation(
        # A rank binds cuda:LOCAL_RANK: its node's GPUs list each rank's own first, in rank order.
        "ray-visible-gpus-sorted",
        "enot_nb/_launch/ray_layout.py",
        "visible_gpus=tuple(firsts + rest) if landing.gpu_ids else (),",
        "visible_gpus=tuple(sorted(firsts + rest)) if landing.gpu_ids else (),",
        [
            "tests/unit/test_ray_layout.py::test_node_ids_that_sort_against_placement_number_ranks_by_placement",
            "tests/unit/test_ray_layout.py::test_each_rank_binds_the_gpu_ray_assigned_it",
        ],
    ),
    Mutation(
        "ray-rank-is-the-bundle",
        "enot_nb/_launch/ray_layout.py",
        "    rank = str(place.rank)\n",
        "    rank = str(place.landing.bundle)\n",
        [
            "tests/unit/test_ray_layout.py::test_node_ids_that_sort_against_placement_number_ranks_by_placement",
        ],
    ),
    Mutation(
        "ray-local-rank-variable-is-the-rank",
        "enot_nb/_launch/ray_layout.py",
        '        "LOCAL_RANK": str(place.local_rank),\n',
        '        "LOCAL_RANK": str(place.rank),\n',
        [
            "tests/unit/test_ray_layout.py::test_node_ids_that_sort_against_placement_number_ranks_by_placement",
            "tests/unit/test_ray_layout.py::test_spread_gives_each_rank_a_node_and_the_variables_follow",
        ],
    ),
    Mutation(
        "ray-local-world-size-variable-is-the-world",
        "enot_nb/_launch/ray_layout.py",
        '        "LOCAL_WORLD_SIZE": str(place.local_world_size),\n',
        '        "LOCAL_WORLD_SIZE": str(world_size),\n',
        [
            "tests/unit/test_ray_layout.py::test_node_ids_that_sort_against_placement_number_ranks_by_placement",
            "tests/unit/test_ray_layout.py::test_spread_gives_each_rank_a_node_and_the_variables_follow",
        ],
    ),
    Mutation(
        "ray-node-rank-variable-is-the-rank",
        "enot_nb/_launch/ray_layout.py",
        '        "NODE_RANK": str(place.node_rank),\n',
        '        "NODE_RANK": str(place.rank),\n',
        [
            "tests/unit/test_ray_layout.py::test_node_ids_that_sort_against_placement_number_ranks_by_placement",
        ],
    ),
    Mutation(
        "ray-group-rank-variable-is-the-rank",
        "enot_nb/_launch/ray_layout.py",
        '        "GROUP_RANK": str(place.node_rank),\n',
        '        "GROUP_RANK": str(place.rank),\n',
        [
            "tests/unit/test_ray_layout.py::test_node_ids_that_sort_against_placement_number_ranks_by_placement",
        ],
    ),
    Mutation(
        "ray-group-world-size-variable-is-the-world",
        "enot_nb/_launch/ray_layout.py",
        '        "GROUP_WORLD_SIZE": str(place.nnodes),\n',
        '        "GROUP_WORLD_SIZE": str(world_size),\n',
        [
            "tests/unit/test_ray_layout.py::test_node_ids_that_sort_against_placement_number_ranks_by_placement",
        ],
    ),
    Mutation(
        "ray-stop-press-not-relayed",
        "enot_nb/_launch/ray_ranks.py",
        "        self._signal([r for r in ranks if r.running], signal.SIGINT)\n",
        "        self._signal([], signal.SIGINT)\n",
        ["tests/ray_engine/test_ray_session.py::test_the_stop_button_interrupts_every_rank_which_stay_idle_after"],
    ),
    Mutation(
        "ray-fork-server-keeps-the-actors-signal-mask",
        "enot_nb/_worker/forkserver.py",
        "    signal.pthread_sigmask(signal.SIG_SETMASK, set())\n",
        "",
        ["tests/ray_engine/test_ray_session.py::test_the_stop_button_interrupts_every_rank_which_stay_idle_after"],
    ),
    Mutation(
        "ray-actor-death-cause-unnamed",
        "enot_nb/_launch/ray_ranks.py",
        "        self.ray_causes[r.rank] = _ray_cause(err)\n",
        "",
        [
            "tests/ray_engine/test_ray_session.py::test_an_actor_killed_mid_cell_fails_the_cell_naming_its_rank_and_node",
            "tests/ray_engine/test_ray_session.py::test_a_node_removed_mid_cell_fails_the_cell_naming_its_rank_and_node",
        ],
    ),
    Mutation(
        "ray-result-cut-short",
        "enot_nb/_launch/ray_agent.py",
        "mmap.mmap(self.result_fd, size, prot=mmap.PROT_READ)",
        "mmap.mmap(self.result_fd, size // 2, prot=mmap.PROT_READ)",
        ["tests/ray_engine/test_ray_session.py::test_big_state_goes_both_ways_through_the_object_store"],
    ),
    Mutation(
        "plain-pickled-again-while-held-still",
        "enot_nb/_state/kinds.py",
        "    if _still is not None and id(obj) in _still:\n",
        "    if False:\n",
        ["tests/cells/test_reach.py::test_a_large_container_is_told_plain_once_while_nothing_changes_it"],
    ),
    Mutation(
        "plain-alias-merged-twice",
        "enot_nb/_state/kinds.py",
        "        return new  # already made to hold another: let go here\n",
        "        return old  # already made to hold another: let go here\n",
        ["tests/cells/test_reach.py::test_plain_data_comes_back_in_place_sets_and_cycles_included"],
    ),
    Mutation(
        "plain-set-replaced",
        "enot_nb/_state/kinds.py",
        "    if type(old) is set:\n        old.clear()\n        old.update(new)\n",
        "    if type(old) is set:\n        return new\n",
        ["tests/cells/test_reach.py::test_plain_data_comes_back_in_place_sets_and_cycles_included"],
    ),
    Mutation(
        "grown-reach-kept-where-a-walk-orders-otherwise",
        "enot_nb/_session/mirror/record.py",
        "    if regrowth.starts and not _walked_last(registry, regrowth):\n",
        "    if False:\n",
        ["tests/session/test_kept_walks.py::test_a_reach_grown_by_new_objects_is_what_a_fresh_walk_gives"],
    ),
    Mutation(
        "grown-reach-new-before-old-kept",
        "enot_nb/_session/mirror/record.py",
        "    if regrowth.replaced or not regrowth.new_after_old or len(holders) != 1:\n",
        "    if regrowth.replaced or len(holders) != 1:\n",
        ["tests/session/test_kept_walks.py::test_a_reach_grown_by_new_objects_is_what_a_fresh_walk_gives"],
    ),
    Mutation(
        "grown-specs-not-sent",
        "enot_nb/_session/kernel/cell_reach.py",
        "            return old.grown(added, count, len(registry.storages)) if added else old\n",
        "            return old\n",
        ["tests/session/test_kept_walks.py::test_a_reach_grown_by_new_objects_is_what_a_fresh_walk_gives"],
    ),
    Mutation(
        "grown-registry-snapshot-not-taken",
        "enot_nb/_session/mirror/kept.py",
        "                    snapshot.retake(registry, list(new_objects), list(new_storages), scan_large=True)\n",
        "                    pass\n",
        ["tests/session/test_kept_walks.py::test_a_reach_grown_by_new_objects_is_what_a_fresh_walk_gives"],
    ),
    Mutation(
        "one-page-area-digest-blind",
        "enot_nb/_memory/digests.py",
        "        return (area[1], zlib.crc32(ctypes.string_at(*area))) if mask[0] and area[1] else (0, 0)\n",
        "        return (area[1], 0) if mask[0] and area[1] else (0, 0)\n",
        ["tests/cells/test_kernel.py::test_trained_model_and_optimizer_come_back_in_place"],
    ),
    Mutation(
        "plain-pickle-kept-across-the-cells-code",
        "enot_nb/_worker/cell.py",
        "    let_go()  # (a session master holds still from finding its registry to here)\n",
        "",
        ["tests/session/test_mirror.py::test_a_plain_log_changed_by_the_cell_that_first_reaches_it_comes_back"],
    ),
    Mutation(
        "kept-specs-stale-beside-a-resized-storage",
        "enot_nb/_session/kernel/cell_reach.py",
        "        on_written = [spec.at for spec in old.specs if written_at.intersection(spec.storages)]"
        " if written_at else []\n",
        "        on_written = []\n",
        ["tests/session/test_kept_walks.py::test_a_reach_grown_by_new_objects_is_what_a_fresh_walk_gives"],
    ),
    Mutation(
        "grown-reach-after-a-later-round",
        "enot_nb/_session/mirror/record.py",
        "        if parent > holder or step.startswith(SET_ITEM) or (parent == 0 and not roots):\n",
        "        if parent > holder or step.startswith(SET_ITEM):\n",
        ["tests/session/test_kept_walks.py::test_a_reach_grown_by_new_objects_is_what_a_fresh_walk_gives"],
    ),
    Mutation(
        "plain-pickle-buffers-taken",
        "enot_nb/_state/kinds.py",
        "        _PlainPickler(out, protocol=5, buffer_callback=_refuse_buffer).dump(obj)\n",
        "        _PlainPickler(out, protocol=5).dump(obj)\n",
        ["tests/cells/test_reach.py::test_a_large_container_is_told_plain_once_while_nothing_changes_it"],
    ),
    Mutation(
        "plain-memo-learns-while-the-cell-runs",
        "enot_nb/_state/kinds.py",
        "    global _still\n    _still = None\n",
        "    if _still is not None:\n        _still.clear()\n",
        ["tests/cells/test_reach.py::test_a_large_container_is_told_plain_once_while_nothing_changes_it"],
    ),
    Mutation(
        "plain-shared-anew-made-two",
        "enot_nb/_state/kinds.py",
        "    if id(new) in made:\n        return made[id(new)]\n",
        "",
        ["tests/cells/test_reach.py::test_plain_data_comes_back_in_place_sets_and_cycles_included"],
    ),
    Mutation(
        "kept-registry-left-half-grown",
        "enot_nb/_session/mirror/kept.py",
        "            except Exception:  # noqa: BLE001 - half grown: the cell finds its objects anew\n",
        "            except LookupError:  # noqa: BLE001 - half grown: the cell finds its objects anew\n",
        ["tests/session/test_kept_walks.py::test_a_kept_registry_that_cannot_grow_is_dropped_whatever_fails"],
    ),
    Mutation(
        "press-leaves-autograd-off",
        "enot_nb/_worker/cell.py",
        "        if isinstance(exc, KeyboardInterrupt):\n            _grad_mode_after_press(grad_before)\n",
        "",
        ["tests/session/test_work_kept.py::test_a_press_inside_a_no_grad_entry_leaves_autograd_as_it_was"],
    ),
    # ------------------------------------------------------------- conflicts settled (issue 43: 2.4, 2.5, --fresh)
    Mutation(
        "no-return-tensor-writes-leave-the-name-current",
        "enot_nb/_worker/cell.py",
        "            written = self.registry.names_holding({new.storage for new in changes.storages})\n",
        "            written: set[str] = set()\n",
        [
            "tests/session/test_mirror.py::test_a_no_return_cells_tensor_write_is_stale_as_a_numpy_write_is",
            "tests/session/test_session_parity.py::test_a_conflict_settled_is_the_side_that_won["
            "a-no-return-tensor-write-then-a-plain-one-keep-notebook-fork]",
            "tests/session/test_session_parity.py::test_a_conflict_settled_is_the_side_that_won["
            "ddp-weights-loaded-in-a-no-return-cell-then-a-plain-write-overwrite-spawn]",
        ],
    ),
    Mutation(
        "any-storage-written-makes-every-tensor-stale",
        "enot_nb/_state/registry.py",
        " and {self.find_storage(s) for s in tensor_storages(self.objects[i])} & storages:",
        ":",
        ["tests/session/test_mirror.py::test_a_no_return_cells_tensor_write_is_stale_as_a_numpy_write_is"],
    ),
    Mutation(
        "keep-notebook-refused-by-another-names-conflict",
        "enot_nb/_session/mirror/mirror.py",
        "            if not pulling and not keeping:\n",
        "            if not pulling:\n",
        [
            "tests/session/test_mirror.py::test_keep_notebook_of_one_name_beside_another_conflict_settles_that_one_alone",
            "tests/session/test_session_parity.py::test_a_conflict_settled_is_the_side_that_won["
            "keep-notebook-of-one-name-beside-another-conflict-fork]",
        ],
    ),
    Mutation(
        "a-kept-name-left-out-of-its-own-push",
        "enot_nb/_session/mirror/mirror.py",
        "        changed_stale -= set(keeping)  # the notebook's side goes\n",
        "",
        [
            "tests/session/test_mirror.py::test_a_stale_name_deleted_here_is_a_conflict_keep_notebook_deletes_it_on_the_ranks",
            "tests/session/test_session_parity.py::test_a_conflict_settled_is_the_side_that_won["
            "a-stale-name-deleted-here-keep-notebook-deletes-it-on-the-ranks-fork]",
        ],
    ),
    Mutation(
        "a-stale-name-the-ranks-alone-were-given-deleted-here-unseen",
        "enot_nb/_session/mirror/mirror.py",
        "        changes.deleted += [n for n in sorted(self.stale) if n not in now and n not in synced]\n",
        "",
        [
            "tests/session/test_mirror.py::test_a_stale_name_deleted_here_is_a_conflict_keep_notebook_deletes_it_on_the_ranks"
            "[bound-on-the-ranks-alone]"
        ],
    ),
    Mutation(
        "a-deleted-stale-name-cannot-be-kept",
        "enot_nb/_session/kernel/flow.py",
        "        missing = [n for n in names if n not in self.namespace and n not in stale]\n",
        "        missing = [n for n in names if n not in self.namespace]\n",
        [
            "tests/session/test_mirror.py::test_a_stale_name_deleted_here_is_a_conflict_keep_notebook_deletes_it_on_the_ranks",
            "tests/session/test_session_parity.py::test_a_conflict_settled_is_the_side_that_won["
            "a-stale-name-deleted-here-keep-notebook-deletes-it-on-the-ranks-spawn]",
        ],
    ),
    Mutation(
        "keep-notebook-settles-before-the-ranks-applied-it",
        "enot_nb/_session/mirror/mirror.py",
        "        for name in names:\n            if name not in namespace or baseline.objects[0] is not namespace:\n",
        "        for name in names:\n            self.stale.pop(name, None)\n            self.conflicts.discard(name)\n"
        "            if name not in namespace or baseline.objects[0] is not namespace:\n",
        ["tests/session/test_mirror.py::test_a_keep_notebook_a_rank_refuses_settles_nothing"],
    ),
    Mutation(
        "a-refused-keep-notebook-settles-its-conflict",
        "enot_nb/_session/kernel/flow.py",
        "            self.still_in_conflict(prepared, [])\n            return\n        self.mirror.refreshed(names)\n",
        "            return\n        self.mirror.refreshed(names)\n",
        ["tests/session/test_mirror.py::test_a_keep_notebook_a_rank_refuses_settles_nothing"],
    ),
    Mutation(
        "a-failed-pull-settles-its-conflict",
        "enot_nb/_session/kernel/flow.py",
        "            self.mirror.conflicts |= (set(prepared.push.settles) - set(settled)) & set(self.mirror.stale)\n",
        "            pass\n",
        [
            "tests/session/test_mirror.py::test_a_keep_notebook_a_rank_refuses_settles_nothing",
            "tests/session/test_mirror.py::test_an_overwrite_the_master_cannot_answer_settles_nothing",
        ],
    ),
    Mutation(
        "a-failed-pull-makes-a-conflict-of-what-it-pulled",
        "enot_nb/_session/mirror/mirror.py",
        "        settles = sorted(changed_stale & {*pulling, *keeping})\n",
        "        settles = sorted({*pulling, *keeping} & set(self.stale))\n",
        ["tests/session/test_mirror.py::test_a_failed_pull_of_a_stale_name_unchanged_here_leaves_no_conflict"],
    ),
    Mutation(
        "keep-notebook-never-settles",
        "enot_nb/_session/kernel/flow.py",
        "        self.mirror.refreshed(names)\n\n",
        "\n",
        [
            "tests/session/test_mirror.py::test_keep_notebook_of_one_name_beside_another_conflict_settles_that_one_alone",
            "tests/session/test_session_parity.py::test_a_conflict_settled_is_the_side_that_won["
            "keep-notebook-of-one-name-beside-another-conflict-fork]",
        ],
    ),
    Mutation(
        "fresh-cells-skipped-as-session-cells",
        "enot_nb/_session/kernel/plain_cells.py",
        '_SESSION_CELL = re.compile(r"\\s*%%enot_distributed\\b(?![^\\n]*--fresh)")\n',
        '_SESSION_CELL = re.compile(r"\\s*%%enot_distributed\\b")\n',
        [
            "tests/unit/test_plain_cells.py::test_a_fresh_cell_is_compared_as_a_plain_one_and_only_its_magic_line_says_so",
            "tests/session/test_session_parity.py::"
            "test_a_fresh_cells_change_reaches_the_ranks_though_only_plain_cells_are_compared",
        ],
    ),
    Mutation(
        "fresh-read-from-the-cell-body",
        "enot_nb/_session/kernel/plain_cells.py",
        '_SESSION_CELL = re.compile(r"\\s*%%enot_distributed\\b(?![^\\n]*--fresh)")\n',
        '_SESSION_CELL = re.compile(r"\\s*%%enot_distributed\\b(?![\\s\\S]*--fresh)")\n',
        [
            "tests/unit/test_plain_cells.py::test_a_fresh_cell_is_compared_as_a_plain_one_and_only_its_magic_line_says_so"
        ],
    ),
    Mutation(
        "fresh-ignored-inside-a-session",
        "enot_nb/magic.py",
        "            if not args.fresh:\n",
        "            if True:\n",
        [
            "tests/session/test_session_parity.py::"
            "test_a_fresh_cells_change_reaches_the_ranks_though_only_plain_cells_are_compared",
            "tests/session/test_session_parity.py::test_a_conflict_settled_is_the_side_that_won["
            "fresh-cells-inside-a-session-change-what-the-ranks-hold-fork]",
        ],
    ),
    Mutation(
        "a-pull-of-a-missing-name-fails-the-rank",
        "enot_nb/_session/worker/loop.py",
        "        return NotHeld(missing, sorted(held))\n",
        '        raise NameError(f"pull: rank 0 has no variable {missing}")\n',
        [
            "tests/session/test_messages.py::"
            "test_a_pull_of_a_name_the_ranks_do_not_hold_is_a_usage_error_naming_it_and_what_they_hold"
        ],
    ),
    Mutation(
        "a-stale-ddp-wrapper-left-unguarded",
        "enot_nb/_session/worker/loop.py",
        "            wrappers.guard_stale(namespace)\n",
        "            pass\n",
        [
            "tests/session/test_messages.py::"
            "test_a_layer_replaced_under_a_live_ddp_wrapper_is_reported_once_saying_what_to_build_again"
        ],
    ),
    Mutation(
        "a-stale-wrapper-reported-by-every-rank",
        "enot_nb/_session/kernel/session.py",
        "        if len(stale) == 1 and all(",
        "        if False and all(",
        [
            "tests/session/test_messages.py::"
            "test_a_layer_replaced_under_a_live_ddp_wrapper_is_reported_once_saying_what_to_build_again"
        ],
    ),
    Mutation(
        "our-reads-of-user-objects-warn",
        "enot_nb/_log.py",
        '        warnings.simplefilter("ignore")\n',
        "        pass\n",
        ["tests/session/test_messages.py::test_our_reads_of_a_users_object_show_no_warning_a_local_cell_would_not"],
    ),
    Mutation(
        # A Sphinx role back in a rendered docstring: mkdocstrings shows it as it is.
        "a-sphinx-role-in-a-docstring",
        "enot_nb/launcher.py",
        "then runs [enot_nb.distributed.init_torch][] with",
        "then runs :func:`enot_nb.distributed.init_torch` with",
        ["tests/test_docs.py::test_no_page_shows_raw_restructuredtext"],
    ),
    Mutation(
        "magic-options-keep-the-literal-marker",
        "docs/hooks/magic_options.py",
        '.format_help().removeprefix("::\\n\\n").split(',
        '.format_help().removeprefix("").split(',
        ["tests/test_docs.py::test_the_magics_options_show_no_raw_markup"],
    ),
    Mutation(
        "notebook-pages-titled-by-their-headings",
        "mkdocs.yml",
        "ignore_h1_titles: true",
        "ignore_h1_titles: false",
        ["tests/test_docs.py::test_notebook_pages_keep_their_titles_from_mkdocs_yml"],
    ),
    Mutation(
        # Chromium looked for at collection: a skip then may say "absent" of what CI installs later.
        "chromium-looked-for-at-collection",
        "tests/frameworks/test_browser.py",
        'CHROMIUM = Path("/usr/bin/chromium")\n',
        'CHROMIUM = Path("/usr/bin/chromium")\n'
        "if not CHROMIUM.exists():\n"
        '    pytest.skip(f"{CHROMIUM} is absent", allow_module_level=True)\n',
        ["tests/frameworks/test_browser_collection.py::test_collecting_the_browser_test_leaves_chromium_to_the_test"],
    ),
    Mutation(
        "repair-takes-the-kernels-copies-for-the-ranks-objects",
        "enot_nb/_worker/held.py",
        "    return [o for o in objects if type(o) in hits and _live(o)] if hits else []\n",
        "    return [o for o in objects if type(o) in hits] if hits else []\n",
        ["tests/session/test_work_kept.py::test_a_zero_optimizer_the_notebook_holds_is_not_taken_for_a_ranks"],
    ),
    Mutation(
        # On Python 3.12.1 the old check (a freeze count of 0) never froze: the same as this.
        "ranks-forked-with-the-kernels-objects-unfrozen",
        "enot_nb/_processes/clean_thread.py",
        "        ours = gc.get_freeze_count() <= _FROZEN_AT_START",
        "        ours = False and gc.get_freeze_count() <= _FROZEN_AT_START",
        ["tests/session/test_lifecycle.py::test_a_forked_rank_does_not_collect_the_kernels_objects"],
    ),
    Mutation(
        "a-view-of-a-strided-known-array-goes-by-its-owner",
        "enot_nb/_serialize/picklers.py",
        "            for known in self.strided_known(root):\n",
        "            for known in []:\n",
        [
            "tests/session/test_mirror.py::test_a_view_of_a_strided_array_the_notebook_holds_comes_back_without_its_owner"
        ],
    ),
    Mutation(
        "a-storage-over-a-strided-known-array-by-value",
        "enot_nb/_serialize/picklers.py",
        "memory.strided_holding(storage) or",
        "None or",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[a-tensor-over-a-strided-array-fork]"
        ],
    ),
    Mutation(
        "a-storage-under-a-known-arrays-tensor-by-value",
        "enot_nb/_serialize/picklers.py",
        "or memory.under_known_array(storage)",
        "or None",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found"
            "[a-tensor-sent-after-the-array-of-a-view-of-it-fork]"
        ],
    ),
    Mutation(
        "an-array-under-a-known-arrays-tensor-by-value",
        "enot_nb/_serialize/picklers.py",
        "        under = self._memory.under_known_array_at(*memory)\n",
        "        under = None\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[an-array-sent-after-a-view-of-its-tensor-fork]"
        ],
    ),
    Mutation(
        "the-owner-of-a-strided-known-array-by-value",
        "enot_nb/_serialize/tensors.py",
        "    owner = array_owner(known)\n"
        "    if (owner.shape, owner.strides, owner.dtype, _address(known) - _address(owner)) != layout:\n",
        "    owner = array_owner(known)\n    if True:\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[a-tensor-over-a-strided-array-fork]"
        ],
    ),
    Mutation(
        "a-storage-over-a-known-arrays-owner-by-value",
        "enot_nb/_serialize/picklers.py",
        "memory.in_known_owner(storage) or",
        "None or",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found[a-tensor-over-an-array-whose-view-went-first-fork]"
        ],
    ),
    Mutation(
        "a-views-owner-not-reached-by-the-push",
        "enot_nb/_session/mirror/mirror.py",
        "    kept = {i for i, _ in changes.objects if i in objects or current.find(baseline.objects[i]) is not None}\n",
        "    kept = {i for i, _ in changes.objects if current.find(baseline.objects[i]) is not None}\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found"
            "[a-view-of-an-array-written-then-rebound-fork]",
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found"
            "[a-tensor-over-an-array-written-then-rebound-fork]",
        ],
    ),
    Mutation(
        "a-generators-snapshot-pickles-its-state-tensor",
        "enot_nb/_state/kinds.py",
        "KindOps(snapshot=_rng_snapshot,",
        "KindOps(snapshot=lambda obj: pickle.dumps(rng_state(obj)),",
        ["tests/unit/test_changes.py::test_an_unchanged_generator_is_unchanged_wherever_its_state_tensor_lies"],
    ),
    Mutation(
        "a-wait-for-the-ranks-blocks-until-they-speak",
        "enot_nb/_launch/attempt.py",
        "        return self.io.selector.select(PRESS_CHECK if timeout is None else min(timeout, PRESS_CHECK))\n",
        "        return self.io.selector.select(timeout)\n",
        ["tests/session/test_presses.py::test_a_press_taken_on_another_thread_stops_a_quiet_cell[session]"],
    ),
    Mutation(
        "a-storage-in-a-strided-tensor-view-only-over-its-owner",
        "enot_nb/_serialize/tensors.py",
        "    if tensor is not None and (known.shape, known.strides) == layout[:2]:\n",
        "    if False:\n",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found"
            "[a-tensor-over-the-strided-array-of-a-tensor-view-fork]"
        ],
    ),
    Mutation(
        "a-write-through-an-item-of-plain-data-not-compared",
        "enot_nb/_session/mirror/mirror.py",
        "objects | shared_objects | _plain_holders(baseline, reached)",
        "objects | shared_objects",
        [
            "tests/session/test_session_parity.py::test_what_the_fuzzer_found_stays_found"
            "[a-record-of-a-list-made-on-the-ranks-written-through-an-alias-fork]"
        ],
    ),
]


def scratch_copy() -> Path:
    """The tree as git sees it (tracked and untracked, not ignored), in a temporary folder."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    target = Path(tempfile.mkdtemp(prefix="enot_nb-mutation-"))
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_symlink():  # docs/notebooks -> ../notebooks: the site is built from the copy
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(source), target / name)
        elif source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def run(mutation: Mutation) -> bool:
    """True if the mutated tree fails every one of the mutation's tests (as it must)."""
    tree = scratch_copy()
    try:
        path = tree / mutation.path
        text = path.read_text()
        if text.count(mutation.old) != 1:
            raise SystemExit(f"{mutation.name}: the text to break is not found once in {mutation.path}")
        path.write_text(text.replace(mutation.old, mutation.new))
        outcome = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:randomly", *mutation.tests],
            cwd=tree,
            capture_output=True,
            text=True,
            # The kernels nbval starts import enot_nb by the path, not the editable install's.
            env=os.environ | {"PYTHONPATH": str(tree)},
        )
        failed = [line.split()[1] for line in outcome.stdout.splitlines() if line.startswith("FAILED ")]
        # A test id fails when it, one of its parametrized cases or (a notebook) a cell of it does.
        missed = [t for t in mutation.tests if not any(f == t or f.startswith((t + "[", t + "::")) for f in failed)]
        caught = outcome.returncode == 1 and not missed  # 5: none collected, 2+: a broken run
        summary = (outcome.stdout.strip().splitlines() or [""])[-1]
        print(f"{'caught' if caught else 'MISSED'}  {mutation.name}: {summary}", flush=True)
        for test in missed:
            print(f"        still green: {test}", flush=True)
        return caught
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def main(names: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    results = [run(m) for m in chosen]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
