"""Processes: the machinery under a launch that makes, watches and ends processes.

The messages (``protocol``: one record per message) and how they travel (``framing``), stop
presses held over the steps that make and record a resource (``interrupts``), the clean thread
that every process is started from (``clean_thread``), the fork server's client
(``forkserver_client``; the server itself runs in ``enot_nb._worker.forkserver``), the
watchdog (``watchdog``, run as ``python -I <file>``) and its client (``watchdog_client``),
what every start shares (``starts``: its error, the tests' fault hooks), groups of workers
(``groups``) and where they meet (``rendezvous``).
Knows nothing of cells, state or tensors.
"""
