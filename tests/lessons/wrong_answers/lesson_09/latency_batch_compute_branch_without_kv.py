"""largest_batch_within bounds the compute-bound branch by the matmuls alone (T / c), forgetting that the KV
read adds to them: max(w, c B) + k B <= T needs (c + k) B <= T."""
CAUGHT_BY = "largest_batch_within"


def largest_batch_within(chip, n_chips, step_time, params, kv_bytes_per_sequence, bytes_per_param, kv_shards=None):
    kv_shards = n_chips if kv_shards is None else kv_shards
    w = params * bytes_per_param / (n_chips * chip.hbm_bandwidth)
    c = 2 * params / (n_chips * chip.flops)
    k = kv_bytes_per_sequence / (kv_shards * chip.hbm_bandwidth)
    if step_time < w:
        return 0
    return int(min((step_time - w) / k if k else float("inf"), step_time / c))
