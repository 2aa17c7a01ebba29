"""Worker: what runs in a worker process, from its fork to ``os._exit``.

Isolation, ``init_torch``, the job and the result (``bootstrap``); the fork server that forks
clean workers (``forkserver``); torchrun-worker adaptations for frameworks (``frameworks``); the
Jupyter front end a worker sees (``frontend``), its streams and logs (``streams``); a cell's run
(``cell``) and its figures (``figures``, ``mpl_backend``)."""
