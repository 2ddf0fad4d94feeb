"""block_hashes hashes each block's tokens on its own: the same block after a different past gets the same hash."""
CAUGHT_BY = "block_hashes"


def block_hashes(tokens, block_size):
    return [hash((None, tuple(tokens[i:i + block_size])))
            for i in range(0, len(tokens) - block_size + 1, block_size)]
