"""Forwarded output (_launch/output.py): rank prefixes, carriage returns, fences."""

from __future__ import annotations

from enot_nb._launch.output import StreamSink


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


def test_two_ranks_bars_never_share_a_line(capsys):
    """tqdm draws a bar without a newline; another rank's bar then starts a line of its own
    instead of running on after it ("[rank 1] bar[rank 0] bar")."""
    one = StreamSink("stdout", show=True, prefix="[rank 1] ")
    zero = StreamSink("stdout", show=True, prefix="[rank 0] ")
    one.feed(b"\rbar 0/3")
    zero.feed(b"\rbar 0/3")
    one.feed(b"\rbar 1/3")
    zero.feed(b"\rbar 1/3\n")
    one.feed(b"done\n")
    assert capsys.readouterr().out == (
        "[rank 1] bar 0/3\n[rank 0] bar 0/3\n[rank 1] bar 1/3\n[rank 0] bar 1/3\n[rank 1] done\n"
    )


def test_alone_on_the_screen_carriage_returns_pass_through(capsys):
    sink = StreamSink("stdout", show=True)
    sink.feed(b"\rstep 0\rstep 1\n", final=True)
    assert capsys.readouterr().out == "\rstep 0\rstep 1\n"


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
