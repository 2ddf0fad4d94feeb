"""release_behind_window decrefs the dead blocks but leaves their ids in the table: the next call decrefs them again."""
from tinyserve.kv_sizing import first_live_block

CAUGHT_BY = "release_behind_window"


def release_behind_window(local_table, num_computed, window, block_size, allocator):
    freed = 0
    for i in range(min(first_live_block(num_computed, window, block_size), len(local_table))):
        if local_table[i] >= 0 and allocator.refcount[local_table[i]] > 0:
            allocator.decref(local_table[i])
            freed += 1
    return freed
