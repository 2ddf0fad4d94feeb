"""first_live_block takes num_computed - window as the oldest visible key: the row at c sees W keys, c - W + 1 .. c."""
CAUGHT_BY = "first_live_block"


def first_live_block(num_computed, window, block_size):
    if window is None:
        return 0
    return max(0, num_computed - window) // block_size
