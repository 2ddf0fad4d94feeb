"""How much KV memory one request needs: the two formulas every caching strategy sizes itself with.

Lesson 2's contiguous cache reserves `max_kv_positions` rows up front; lesson 4's paged pool hands out
`blocks_for(positions, bs)` blocks as a request grows, and the engine refuses a request whose most positions could
never fit the whole pool (`max_kv_blocks`: the one pool-fit rule, used by the engine, generate_stream and the chat).
They live below both lessons' modules so that neither imports the other.
"""
from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` positions: ceil(num_tokens / block_size) (elementwise on an array)."""
    return -(-num_tokens // block_size)


def max_kv_positions(prompt_len: int, max_new_tokens: int, max_seq_len: int) -> int:
    """The most K/V positions one request can ever hold in a cache (every strategy sizes its memory with this).

    Its tokens are the prompt plus up to max_new_tokens outputs, capped by the context window; the last sampled
    token is never fed back, hence the - 1. But never fewer than the prompt: a prompt that fills the whole
    window still runs through the model once, to sample its one token.
    """
    return max(prompt_len, min(prompt_len + max_new_tokens, max_seq_len) - 1)


def max_kv_blocks(prompt_len: int, max_new_tokens: int, max_seq_len: int, block_size: int) -> int:
    """The most KV blocks of `block_size` one request can ever hold: the pool-fit rule. A pool with fewer blocks
    could never run it, however many other requests were preempted (Engine refuses it; generate_stream sizes its
    pool with exactly this many; the chat drops old turns until it fits)."""
    return blocks_for(max_kv_positions(prompt_len, max_new_tokens, max_seq_len), block_size)


# --- lesson 11: a sliding-window layer's K/V -----------------------------------------------------------------------
# A local layer with window W lets the row at position p see keys p - W + 1 .. p only. So once a sequence has
# computed c positions, its next chunk (whose first row sits at position c) never reads a key before c - W + 1,
# and every block wholly before that key is dead for the local layers: it can go back to the pool.


def first_live_block(num_computed: int, window: int | None, block_size: int) -> int:
    """The first logical block a local layer still reads once `num_computed` positions are in the cache: the one
    holding key num_computed - window + 1 (0 for a global layer, window None, or while the window reaches back to
    position 0). Blocks before it may be freed."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def local_blocks_bound(window: int, block_size: int, max_running: int, max_batch_tokens: int) -> int:
    """The most local-layer blocks an engine can ever hold at once, so a local pool this large never runs dry.

    Between steps a running request holds the blocks of its last `window - 1` keys plus the one being filled:
    at most blocks_for(window - 1) + 1. A step's chunks add at most blocks_for(chunk) + 1 each, and the chunks of a
    step sum to at most max_batch_tokens. So the local pool is sized by the window and the batch, never by the
    context length; and since it cannot run out, the scheduler only ever plans the global layers' pool."""
    return max_running * (blocks_for(window - 1, block_size) + 2) + blocks_for(max_batch_tokens, block_size)


def paged_kv_bytes(config, num_positions: int, block_size: int = 16, bytes_per_value: int = 4,
                   free_behind_window: bool = True) -> tuple[int, int]:
    """(global layers' bytes, local layers' bytes) of the K/V blocks one sequence holds once `num_positions`
    positions are computed (between two steps), in a paged pool of `block_size`. A global layer holds
    blocks_for(num_positions) blocks; a local layer only those from first_live_block on, unless the blocks behind
    the window are kept (free_behind_window=False: every layer holds them all, as without a window)."""
    per_block = 2 * block_size * config.n_kv_heads * config.head_dim * bytes_per_value   # K and V of one layer
    n_local = sum(config.layer_window(i) is not None for i in range(config.n_layers))
    n_blocks = blocks_for(num_positions, block_size)
    local_blocks = n_blocks
    if free_behind_window and n_local:
        local_blocks -= first_live_block(num_positions, config.sliding_window, block_size)
    return (config.n_layers - n_local) * n_blocks * per_block, n_local * local_blocks * per_block
