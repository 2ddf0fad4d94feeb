"""release_behind_window drops every reference of a dead block, though another owner (the cache) still holds it."""
from tinyserve.kv_sizing import first_live_block

CAUGHT_BY = "release_behind_window"


def release_behind_window(local_table, num_computed, window, block_size, allocator):
    freed = 0
    for i in range(min(first_live_block(num_computed, window, block_size), len(local_table))):
        if local_table[i] >= 0:
            while not allocator.decref(local_table[i]):
                pass
            local_table[i] = -1
            freed += 1
    return freed
