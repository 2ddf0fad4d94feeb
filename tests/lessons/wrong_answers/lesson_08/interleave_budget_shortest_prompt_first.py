"""interleave_budget hands the prefill budget to the shortest remaining prompt first (shortest-job-first): good for
mean TTFT, but a long prompt can starve behind a stream of short ones (not first come, first served)."""
CAUGHT_BY = "interleave_budget"


def interleave_budget(num_decoding, prefill_remaining, token_budget):
    decodes = min(num_decoding, token_budget)
    left = token_budget - decodes
    chunks = [0] * len(prefill_remaining)
    for i in sorted(range(len(prefill_remaining)), key=lambda i: prefill_remaining[i]):
        take = min(prefill_remaining[i], left)
        chunks[i] = take
        left -= take
    return decodes, chunks
