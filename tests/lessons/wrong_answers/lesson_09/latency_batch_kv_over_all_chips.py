"""largest_batch_within spreads the KV read over all n_chips even when the cache lives on kv_shards of them."""
CAUGHT_BY = "largest_batch_within"


def largest_batch_within(chip, n_chips, step_time, params, kv_bytes_per_sequence, bytes_per_param, kv_shards=None):
    w = params * bytes_per_param / (n_chips * chip.hbm_bandwidth)
    c = 2 * params / (n_chips * chip.flops)
    k = kv_bytes_per_sequence / (n_chips * chip.hbm_bandwidth)
    if step_time < w:
        return 0
    return int(min((step_time - w) / k if k else float("inf"), step_time / (c + k)))
