"""largest_batch_within charges each chip the whole KV read of every sequence (no division by kv_shards)."""
CAUGHT_BY = "largest_batch_within"


def largest_batch_within(chip, n_chips, step_time, params, kv_bytes_per_sequence, bytes_per_param, kv_shards=None):
    w = params * bytes_per_param / (n_chips * chip.hbm_bandwidth)
    c = 2 * params / (n_chips * chip.flops)
    k = kv_bytes_per_sequence / chip.hbm_bandwidth
    if step_time < w:
        return 0
    return int(min((step_time - w) / k if k else float("inf"), step_time / (c + k)))
