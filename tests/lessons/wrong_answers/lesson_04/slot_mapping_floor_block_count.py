"""slot_mapping counts the blocks the positions need with floor division, so it misses a table that is one block short."""
import numpy as np

CAUGHT_BY = "slot_mapping"


def slot_mapping(block_table, start, count, block_size):
    if start < 0 or count < 0:
        raise ValueError("negative")
    table = np.asarray(block_table, dtype=np.int64)
    pos = np.arange(start, start + count, dtype=np.int64)
    needed = (start + count) // block_size            # the mistake: should round up
    if needed > len(table) or (count and np.any(table[pos[0] // block_size:needed] < 0)):
        raise ValueError("not allocated")
    return table[pos // block_size % len(table)] * block_size + pos % block_size
