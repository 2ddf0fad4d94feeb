"""rewind_blocks keeps (num_tokens - n) // block_size blocks, rounding down: a block that still holds kept positions
is freed when the kept length is not a multiple of the block size (the sequence then reads a block someone else
may reuse)."""
from tinyserve.config import is_int

CAUGHT_BY = "rewind_blocks"


def rewind_blocks(block_table, num_tokens, n, block_size, allocator):
    if not is_int(num_tokens) or not 0 <= num_tokens <= len(block_table) * block_size:
        raise ValueError("rewind_blocks: num_tokens out of range")
    if not is_int(n) or not 0 <= n <= num_tokens:
        raise ValueError("rewind_blocks: n out of range")
    keep = (num_tokens - n) // block_size
    dropped = block_table[keep:]
    del block_table[keep:]
    for block in reversed(dropped):
        allocator.decref(block)
    return dropped
