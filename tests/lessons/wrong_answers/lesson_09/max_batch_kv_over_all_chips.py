"""max_batch divides each sequence's KV over all n_chips even when only kv_shards chips share it (the others
hold replicas): too many sequences fit on paper."""
CAUGHT_BY = "max_batch"


def max_batch(chip, n_chips, context, params, kv_bytes_per_token, bytes_per_param, reserved_bytes=0, kv_shards=None):
    free = chip.hbm_bytes - reserved_bytes - params * bytes_per_param / n_chips
    if free <= 0:
        return 0
    return int(free // (context * kv_bytes_per_token / n_chips))
