"""Runtime: the torch.distributed machinery under the public [enot_nb.distributed][]:
torchrun's variables (``env``), the backend and device of a rank (``devices``), and
``sync_model``'s buckets (``sync``). Runs in workers and under torchrun."""
