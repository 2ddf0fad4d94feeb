"""slot_mapping computes table[p % bs] * bs + p // bs (block index and offset swapped)."""
import numpy as np

CAUGHT_BY = "slot_mapping"


def slot_mapping(block_table, start, count, block_size):
    if start < 0 or count < 0:
        raise ValueError("negative")
    table = np.asarray(block_table, dtype=np.int64)
    pos = np.arange(start, start + count, dtype=np.int64)
    if -(-(start + count) // block_size) > len(table) or (count and np.any(table < 0)):
        raise ValueError("not allocated")
    return table[np.minimum(pos % block_size, len(table) - 1)] * block_size + pos // block_size
