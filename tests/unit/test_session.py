"""The session's own lines (_session/kernel/session.py): what a restart says it restored."""

from __future__ import annotations

from enot_nb._session.kernel.session import restart_line


def test_a_restart_line_says_what_went_back_to_the_gpu_and_what_to_the_cpu():
    line = restart_line(2, True, "rank 1 died (SIGKILL)", ["ddp"], [], ["lr", "model", "opt"], ["model", "opt"])
    assert line == (
        "enot_nb: session restarted (rank 1 died (SIGKILL)): 2 new worker(s); restored from the notebook "
        "(on the CPU): lr; restored onto each rank's GPU, where it lived: model, opt; gone, as it lived "
        "only on the workers: ddp"
    )
    assert "GPU" not in restart_line(2, True, None, [], [], ["x"])


def test_a_ranks_registry_holds_one_placeholder_for_all_it_lacks():
    """A push is pickled against the whole record (300k objects after a cell read 300k dicts):
    the slots a rank fills with nothing cost no object each, every task."""
    from enot_nb._session.mirror import paths

    registry = paths.registry_at({}, [], 300_000, 0, strict=True)
    assert len({id(obj) for obj in registry.objects[1:]}) == 1 and paths.has_placeholders(registry)
