"""block_hashes also hashes the trailing partial block (which is never cached)."""
CAUGHT_BY = "block_hashes"


def block_hashes(tokens, block_size):
    out, parent = [], None
    for i in range(0, len(tokens), block_size):
        parent = hash((parent, tuple(tokens[i:i + block_size])))
        out.append(parent)
    return out
