"""State: what the notebook holds, what a cell changed and how the changes come back in place.

The object kinds and their operations (``kinds``), the registry of the notebook's objects and
snapshots (``objgraph``), which pages a worker wrote (``pagemap``), the changes collected on
the master (``collect``) and applied to the notebook's own objects (``apply``)."""
