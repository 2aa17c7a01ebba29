"""Processes: the machinery under a launch that makes, watches and ends processes.

The worker protocol and its framing (``protocol``), stop presses held over the steps that make
and record a resource (``interrupts``), the clean thread that forks, the fork server's and the
watchdog's clients (``spawn``), groups of workers (``groups``), where they meet
(``rendezvous``) and the watchdog itself (``watchdog``, run as ``python -I <file>``).
Knows nothing of cells, state or tensors.
"""
