"""export_kv reads the blocks after the sequence's first block as if they were its next physical blocks
(pool[first : first + n]), ignoring the rest of the block table: right whenever the allocator happened to hand out
consecutive blocks (one block, or an empty pool), wrong once blocks come back freed in another order."""
from tinyserve.kv_sizing import blocks_for

CAUGHT_BY = "export_kv"


def export_kv(engine, seq, num_positions):
    bs = engine.block_size
    first = seq.block_table[0]
    n = blocks_for(num_positions, bs)
    L, _, _, K, H = engine.pool.k.shape
    k = engine.pool.k[:, first:first + n].reshape(L, -1, K, H)[:, :num_positions]
    v = engine.pool.v[:, first:first + n].reshape(L, -1, K, H)[:, :num_positions]
    return k, v
