"""first_live_block subtracts the window in whole blocks (c // bs - W // bs), ignoring where inside its block c is."""
CAUGHT_BY = "first_live_block"


def first_live_block(num_computed, window, block_size):
    if window is None:
        return 0
    return max(0, num_computed // block_size - window // block_size)
