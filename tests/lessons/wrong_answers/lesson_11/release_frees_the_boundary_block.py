"""release_behind_window also frees the block holding the oldest key the next row still sees."""
from tinyserve.kv_sizing import first_live_block

CAUGHT_BY = "release_behind_window"


def release_behind_window(local_table, num_computed, window, block_size, allocator):
    freed = 0
    for i in range(min(first_live_block(num_computed, window, block_size) + 1, len(local_table))):
        if local_table[i] >= 0:
            allocator.decref(local_table[i])
            local_table[i] = -1
            freed += 1
    return freed
