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
