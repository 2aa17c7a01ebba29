"""One attempt's failures and stop reports (_launch/attempt.py)."""

from __future__ import annotations


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


def test_a_sigkill_is_the_oom_killers_only_where_its_count_rose():
    from enot_nb.errors import WorkerFailure, sigkill_cause

    assert "the kernel's out-of-memory killer" in sigkill_cause(3, 4)
    assert sigkill_cause(3, 3).startswith("not the out-of-memory killer")
    assert "if the kernel log says so" in sigkill_cause(None, 2) and "if the kernel log says so" in sigkill_cause(
        2, None
    )
    died = WorkerFailure.died(1, -9, 0, "", sigkill_cause(0, 1))
    assert "killed by SIGKILL (the kernel's out-of-memory killer" in died.summary()
    assert "if the kernel log says so" in WorkerFailure.died(1, -9, 0, "").summary()  # nobody counted


def test_a_stop_report_keeps_the_users_frames_and_the_innermost_library_ones():
    from enot_nb._launch.attempt import stack_report

    dump = "\n".join(
        [
            "Current thread 0x00007f (most recent call first):",
            '  File "/env/lib/python3.11/site-packages/torch/autograd/graph.py", line 1 in _engine_run_backward',
            '  File "/env/lib/python3.11/site-packages/torch/autograd/__init__.py", line 2 in backward',
            '  File "/env/lib/python3.11/site-packages/torch/_tensor.py", line 3 in backward',
            '  File "/env/lib/python3.11/site-packages/torch/_tensor.py", line 4 in deeper',
            '  File "/tmp/ipykernel_1/2.py", line 9 in train_epoch',
            '  File "/env/lib/python3.11/site-packages/lightning/loop.py", line 5 in run',
            '  File "<enot_distributed cell>", line 2 in <module>',
        ]
    )
    report = stack_report(1, dump).splitlines()
    assert report[0] == "[rank 1] where it was (most recent call first):"
    assert [line.split('"')[1].rsplit("/", 1)[-1] for line in report[1:-1]] == [
        "graph.py",
        "__init__.py",
        "_tensor.py",
        "2.py",
        "<enot_distributed cell>",
    ]
    assert report[-1] == "[rank 1]   (2 library frame(s) left out; ENOT_NB_DEBUG=1 logs the whole dump)"
