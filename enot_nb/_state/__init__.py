"""State: what the notebook holds, what a cell changed and how the changes come back in place.

kinds     the object kinds, and one table of what is done with each (walk, snapshot,
          compare, send, apply)
states    the named records of an object's shallow state
registry  every object the namespace reaches, by index
reach     the names a cell uses; under spawn, what of the notebook travels
digests   whether memory changed (digests, and pages a worker wrote: pagemap)
snapshot  the master's record before the cell, and what changed since
collect   the changes, pickled against the registry (master)
apply     the changes resolved to the notebook's own objects and applied in place (kernel)
salvage   when one object fails to load in the kernel: the rest loaded, that one named (kernel)
"""
