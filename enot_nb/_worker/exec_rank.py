"""A Ray rank's worker, started by its agent as ``python -m enot_nb._worker.exec_rank``.

The agent launches its rank once, so a fork server (an interpreter kept to fork workers quickly)
would only add a process per rank: the agent's clean thread starts this module instead
(``groups.ExecGroup``), which reads its WorkerSpec and the job from stdin and becomes the worker.
"""

from __future__ import annotations

import pickle
import signal
import sys

from enot_nb._serialize import picklers
from enot_nb._worker import bootstrap


def main() -> None:
    # Until it is a worker (become_worker sets both): a stop press or a stack dump asked for now
    # must not end it, as a fork server's child inherits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # A mask survives exec: a Ray actor's threads block SIGINT and SIGTERM, and a stop press
    # would never reach the rank (see forkserver.main).
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    spec, job_bytes = pickle.load(sys.stdin.buffer)
    bootstrap.run(spec, lambda: picklers.loads_shipped(job_bytes))


if __name__ == "__main__":
    main()
