"""Framing (_processes/framing.py): messages and descriptors over pipes and sockets."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from enot_nb._launch.ranks import STREAMS, RankIO, make_ranks
from enot_nb._processes import framing
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
