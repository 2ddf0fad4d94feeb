"""interleave_budget serves the waiting prompts before the running decodes: a long prompt can then take the whole
budget and every running request's next token waits behind it."""
CAUGHT_BY = "interleave_budget"


def interleave_budget(num_decoding, prefill_remaining, token_budget):
    left = token_budget
    chunks = []
    for remaining in prefill_remaining:
        take = min(remaining, left)
        chunks.append(take)
        left -= take
    return min(num_decoding, left), chunks
