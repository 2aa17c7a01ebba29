"""Serialization: pickling between the notebook and its workers (tensor aliasing kept, NumPy and
torch memory that is shared stays shared, tensor bytes out of band, one shared-memory file per
launch, the result file). Knows nothing of cells or of what changed."""
