"""Fast unit tests of the pure pieces: framing, result layout, prefixing, change tracking,
bucket planning, options and errors. No process is started here."""

from __future__ import annotations

import inspect
import os
import pickle
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import enot_nb
from enot_nb._launch.options import LaunchOptions
from enot_nb._launch.output import StreamSink
from enot_nb._launch.ranks import STREAMS, RankIO, make_ranks
from enot_nb._processes import framing
from enot_nb._runtime.sync import _plan
from enot_nb._serialize import result_file
from enot_nb._state import collect
from enot_nb._state.registry import Registry
from enot_nb._state.snapshot import Snapshot
from enot_nb.errors import LaunchConfigError, WorkerFailedError, WorkerFailure
from tests._util import press_before_line


def test_framing_reassembles_messages_split_anywhere():
    data = framing.encode(("a", 1)) + framing.encode({"b": [2, 3]})
    reader = framing.MessageReader()
    messages = []
    for i in range(len(data)):
        messages += reader.feed(data[i : i + 1])
    assert messages == [("a", 1), {"b": [2, 3]}]


def test_more_than_253_descriptors_travel_in_batches():
    ours, theirs = socket.socketpair()
    pipes = [os.pipe() for _ in range(300)]
    try:
        framing.send_message(ours, ("launch", 1), [w for _, w in pipes])
        reader = framing.MessageReader()
        assert framing.recv_message(theirs, reader) == ("launch", 1)
        received = framing.recv_fds(theirs, reader, 300)
        assert len(received) == 300 and not reader.pending
        os.write(received[299], b"x")
        assert os.read(pipes[299][0], 1) == b"x"  # the order is kept
        for fd in received:
            os.close(fd)
    finally:
        for pair in pipes:
            for fd in pair:
                os.close(fd)
        ours.close()
        theirs.close()


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


def test_prefixing_gives_each_redraw_a_line_of_its_rank(capsys):
    """With several ranks on one screen a \\r would draw one rank's bar over another's line:
    each redraw starts a fresh line of its own rank (what the worker wrote stays in the tail)."""
    sink = StreamSink("stdout", show=True, prefix="[rank 1] ")
    sink.feed(b"one\ntw")
    sink.feed(b"o\rthree\n")
    sink.feed(b"\r 10%|#  |\r 20%|## |")  # tqdm: a carriage return, then the bar
    sink.feed(b"\r100%|###|\n", final=True)
    assert capsys.readouterr().out == (
        "[rank 1] one\n[rank 1] two\n[rank 1] three\n[rank 1]  10%|#  |\n[rank 1]  20%|## |\n[rank 1] 100%|###|\n"
    )
    assert "\r100%" in sink.tail()


def test_alone_on_the_screen_carriage_returns_pass_through(capsys):
    sink = StreamSink("stdout", show=True)
    sink.feed(b"\rstep 0\rstep 1\n", final=True)
    assert capsys.readouterr().out == "\rstep 0\rstep 1\n"


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


def test_bucket_planning_packs_small_tensors_and_keeps_large_ones_alone():
    tensors = [torch.zeros(n) for n in (4, 4, 100, 4, 4, 4)]
    plan = _plan(tensors, capacity=8, in_place=lambda t: t.numel() >= 100)
    assert [[t.numel() for t in bucket] for bucket in plan] == [[100], [4, 4], [4, 4], [4]]


def test_launch_options_are_one_definition_for_every_front():
    fields = set(LaunchOptions.names())
    launcher = set(inspect.signature(enot_nb.notebook_launcher).parameters)
    assert fields <= launcher
    export = set(inspect.signature(enot_nb.export_cell).parameters)
    # An export runs nothing here: where and how torchrun starts it is torchrun's to say.
    assert fields - {"start_method", "node_rank", "max_restarts"} <= export
    from enot_nb.magic import EnotMagics

    parser = EnotMagics.enot_distributed.parser
    dests = {action.dest for action in parser._actions}
    renamed = {"cuda_optimize_for_speed": "speed", "cuda_reproducible": "reproducible"}
    assert {renamed.get(name, name) for name in fields} <= dests
    flags = {s for action in parser._actions for s in action.option_strings}
    assert set(LaunchOptions.FLAGS.values()) <= flags


@pytest.mark.parametrize(
    "options, parameter",
    [
        ({"nprocs": 0}, "nprocs"),
        ({"timeout": float("nan")}, "timeout"),
        ({"seed": 2**40}, "seed"),
        ({"cuda_optimize_for_speed": True, "cuda_reproducible": True}, "cuda_reproducible"),
        ({"nnodes": 2}, "master_port"),
        ({"output": "loud"}, "output"),
    ],
)
def test_bad_options_name_their_parameter(options, parameter):
    with pytest.raises(LaunchConfigError) as caught:
        LaunchOptions(**options)
    assert caught.value.parameter == parameter


def test_errors_survive_a_pickle_round_trip():
    failure = WorkerFailure(rank=1, exitcode=-9, signal_name="SIGKILL", error_type=None, message="", traceback=None)
    err = pickle.loads(pickle.dumps(WorkerFailedError([failure])))
    assert err.rank == 1 and err.signal_name == "SIGKILL" and "SIGKILL" in str(err)
    config = pickle.loads(pickle.dumps(LaunchConfigError("bad", parameter="seed")))
    assert config.parameter == "seed" and str(config) == "bad"


@pytest.mark.parametrize(
    "nprocs, gpus, backend",
    [(2, 0, "gloo"), (2, 1, "gloo"), (2, 2, "nccl"), (1, 8, "nccl"), (8, 8, "nccl"), (9, 8, "gloo")],
)
def test_default_backend(nprocs, gpus, backend):
    from enot_nb._runtime.devices import default_backend

    assert default_backend(nprocs, gpus) == backend


def test_device_for_a_local_rank():
    from enot_nb._runtime.devices import device_for

    assert [device_for(rank, 4) for rank in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="only 2 GPU"):
        device_for(2, 2)
    with pytest.raises(ValueError, match="no GPU is available"):
        device_for(0, 0)


def test_fenced_stream_releases_each_piece_after_its_message():
    from enot_nb._launch.output import Fenced
    from enot_nb._processes.protocol import OUTPUT_FENCE

    stream = Fenced()
    data = b"a" + OUTPUT_FENCE + b"b" + OUTPUT_FENCE + b"c"
    for i in range(0, len(data), 3):  # in chunks that cut the fences
        stream.add(data[i : i + 3])
    assert stream.fences == 2
    assert stream.release(0) == b"a"  # no message handled yet: only what came before the first
    assert stream.release(1) == b"b"
    assert stream.release(2) == b"c"
    stream.add(OUTPUT_FENCE[:4])  # may be a fence: held back until more arrives
    assert stream.release(2) == b""
    stream.add(b"", final=True)  # it was not: the stream ended
    assert stream.release(2, everything=True) == OUTPUT_FENCE[:4]


def test_a_stopped_rank_that_exited_with_a_code_may_be_the_root_cause():
    import signal

    from enot_nb._launch.ranks import Rank

    r = Rank(rank=1, local_rank=1, pipes={}, sinks={})
    assert not r.stopped_by_us(-signal.SIGTERM)  # never signalled: any death is its own
    r.stop_signals.add(signal.SIGTERM)
    r.stop_signals.add(signal.SIGKILL)
    assert r.stopped_by_us(-signal.SIGTERM) and r.stopped_by_us(-signal.SIGKILL)
    assert not r.stopped_by_us(7)  # os._exit(7) just before our SIGTERM reached it
    r.stop_signals = {signal.SIGTERM}
    assert not r.stopped_by_us(-signal.SIGKILL)  # killed by another before our SIGTERM
    r.stop_signals.add(signal.SIGINT)
    assert r.stopped_by_us(1)  # after an interrupt, whatever it did is ours


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
    data = Path(__file__).with_name("data") / "results_9af6e15.pkl"
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


def test_a_stop_press_anywhere_in_reading_a_pipe_end_leaves_it_readable_again():
    """CI saw a KeyboardInterrupt land between the unregistering of a pipe at its end and the
    bookkeeping: the interrupt's own drain then failed with "13 is not registered". A press before
    any line of the reading must leave a state that the next drain and close() finish."""

    def run(interrupt_at: int | None) -> int:
        ranks = make_ranks(1, 0, "none")
        r = ranks[0]
        for name in STREAMS:
            os.write(r.pipes[name][1], b"" if name == "msg" else b"x\n")
        io = RankIO(ranks, None, lambda rank, info: None)
        io.close_write_ends()  # as the launcher does once the workers hold them
        codes = {RankIO.read.__code__, RankIO._show.__code__, RankIO.drain.__code__}
        where: list[str] = []
        seen, tracer = press_before_line(interrupt_at, codes.__contains__, where)
        sys.settrace(tracer)
        try:
            io.drain(r)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        assert interrupt_at is None or where, "the press was not made"
        io.drain(r)  # what the interrupt's handling does next
        assert not r.open_reads and not io.selector.get_map()
        io.close()
        for fd in (fd for name in STREAMS for fd in r.pipes[name]):
            with pytest.raises(OSError):
                os.fstat(fd)
        return seen[0]

    lines = run(None)
    assert lines > 10
    for k in range(1, lines + 1):
        run(k)


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


def test_a_stack_report_shows_the_cell_first_and_leaves_helper_threads_out():
    from enot_nb._launch.attempt import stack_report

    dump = (
        "Thread 0x00007f01 (most recent call first):\n"
        '  File "/usr/lib/python3.11/multiprocessing/queues.py", line 231 in _feed\n'
        '  File "/usr/lib/python3.11/threading.py", line 975 in run\n'
        "\n"
        "Thread 0x00007f02 (most recent call first):\n"
        '  File "/home/me/train.py", line 9 in log_every_second\n'
        '  File "/usr/lib/python3.11/threading.py", line 975 in run\n'
        "\n"
        "Current thread 0x00007f03 (most recent call first):\n"
        '  File "/env/torch/utils/data/dataloader.py", line 1292 in _get_data\n'
        '  File "<enot_distributed cell>", line 4 in <module>\n'
    )
    report = stack_report(1, dump).splitlines()
    assert report[0] == "[rank 1] where it was (most recent call first):"
    assert "_get_data" in report[1] and "<enot_distributed cell>" in report[2]  # the cell's thread first
    assert "log_every_second" in report[3]  # the user's own thread stays
    assert not any("queues.py" in line for line in report)
    assert report[-1] == "[rank 1]   (1 helper thread(s) left out: queue feeders, DataLoader's pin memory)"


@pytest.mark.parametrize(
    "line, words",
    [
        ("", "pass -n N (for example -n 2, --backend gloo)"),  # no GPU here: -n has no default
        ("-n 2 --timeout -3", "--timeout -3.0 must be positive and finite"),
        ("-n 2 --speed --reproducible", "--speed and --reproducible are mutually exclusive"),
    ],
)
def test_magic_errors_speak_the_magics_words(line, words):
    """A launcher message shown for the magic names the flags the user typed, never the
    launcher's keyword arguments."""
    from IPython.core.error import UsageError

    from enot_nb.launcher import LaunchOptions
    from enot_nb.magic import parse_options

    with pytest.raises(UsageError) as info:
        parse_options(line)
    assert words in str(info.value)
    assert not any(f"{name}=" in str(info.value) for name in LaunchOptions.FLAGS), str(info.value)


def test_only_options_are_put_in_the_magics_words():
    from enot_nb.magic import in_magic_words

    assert in_magic_words("/home/me/output/seed_3/nprocs/train.py is a link") == (
        "/home/me/output/seed_3/nprocs/train.py is a link"
    )
    assert in_magic_words("the backend is not available; use a seed") == "the backend is not available; use a seed"
    assert in_magic_words("seed='abc def' and nprocs=2") == "--seed 'abc def' and -n 2"
    assert in_magic_words("cuda_reproducible=False") == "no --reproducible"


def test_the_kernel_tells_which_pages_were_written_since_a_reset_and_only_those():
    """writes.WRITES: one element written after a reset is one page; a second reset makes the
    first epoch unusable (None: the caller takes everything as written); a forked child's
    writes are its own; a fresh reset sees nothing written. The first and last pages are left
    out: they hold the allocator's neighbours too (digests compares their bytes instead)."""
    import os

    import torch

    from enot_nb._memory.writes import PAGE, WRITES

    if not WRITES.available():
        pytest.skip("this kernel or sandbox refuses userfaultfd's asynchronous write protection")
    t = torch.zeros(2**22)  # 16 MiB
    storage = t.untyped_storage()
    area = (storage.data_ptr(), storage.nbytes())
    (epoch,) = WRITES.reset([area])
    assert epoch is not None and not WRITES.written(area, epoch)[1:-1].any()
    t[2**21] = 1.0
    pid = os.fork()
    if pid == 0:
        t[7] = 2.0  # the child's page
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    interior = WRITES.written(area, epoch)[1:-1]
    offset = (storage.data_ptr() % PAGE + 2**21 * 4) // PAGE
    assert (interior.nonzero()[0] + 1).tolist() == [offset]
    (again,) = WRITES.reset([area])
    assert WRITES.written(area, epoch) is None and not WRITES.written(area, again)[1:-1].any()


def test_storages_whose_writes_are_not_told_are_digested_whole(monkeypatch):
    """A long-lived snapshot digests whole what the kernel cannot track for it: a storage in
    memory shared with other processes (their writes go through their own page tables: a
    forked child's write into its interior is seen), and one past the tracker's registrations
    (MAX_REGISTRATIONS)."""
    import mmap
    import os

    from enot_nb._memory import digests, writes

    if not writes.WRITES.available():
        pytest.skip("this kernel or sandbox refuses userfaultfd's asynchronous write protection")
    maps = [mmap.mmap(-1, 2**18) for _ in range(2)]  # pages that no registration covers yet
    shared = torch.zeros(2**16).share_memory_()  # 256 KiB: tracked, if it were not shared
    plain, capped = (torch.frombuffer(m, dtype=torch.float32) for m in maps)
    storages = [shared.untyped_storage(), plain.untyped_storage()]
    before = digests.storage_digests(storages, scan_large=True)
    assert [type(d).__name__ for d in before] == ["AreaDigest", "PagesDigest"]
    pid = os.fork()
    if pid == 0:
        shared[2**15] = 1.0  # the child's write, into shared memory
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert digests.changed_storages(storages, before) == [0]
    monkeypatch.setattr(writes, "MAX_REGISTRATIONS", writes.WRITES._registered)  # no room for another
    (digest,) = digests.storage_digests([capped.untyped_storage()], scan_large=True)
    assert type(digest).__name__ == "AreaDigest"
    capped[2**15] = 1.0
    assert digests.changed_storages([capped.untyped_storage()], [digest]) == [0]
    del plain, capped, storages
    for m in maps:
        m.close()


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
