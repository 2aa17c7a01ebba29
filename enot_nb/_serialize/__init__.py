"""Serialization: pickling between the notebook and its workers (tensor aliasing kept, NumPy and
torch memory that is shared stays shared, tensor bytes out of band, one shared-memory file per
launch, the result file). Knows nothing of cells or of what changed.

    shm          the memfd of shipped tensors, private mappings of it and of results
    tensors      tensors, storages and NumPy arrays: their reducers and rebuild functions
    picklers     the pickler of each direction (ship, result), dry runs, loading in a worker
    result_file  rank 0's result laid out in a memfd, and read back
    renamed      saved files that name modules since moved still load
"""
