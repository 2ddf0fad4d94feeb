"""slot_mapping only checks the table's length, not its -1 (unallocated) entries: it returns negative slots."""
import numpy as np

CAUGHT_BY = "slot_mapping"


def slot_mapping(block_table, start, count, block_size):
    if start < 0 or count < 0:
        raise ValueError("negative")
    table = np.asarray(block_table, dtype=np.int64)
    pos = np.arange(start, start + count, dtype=np.int64)
    if -(-(start + count) // block_size) > len(table):
        raise ValueError("table too short")
    return table[pos // block_size] * block_size + pos % block_size
