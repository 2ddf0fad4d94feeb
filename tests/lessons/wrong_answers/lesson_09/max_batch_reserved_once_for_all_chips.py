"""max_batch subtracts reserved_bytes once from all chips' memory together instead of on every chip."""
CAUGHT_BY = "max_batch"


def max_batch(chip, n_chips, context, params, kv_bytes_per_token, bytes_per_param, reserved_bytes=0, kv_shards=None):
    kv_shards = n_chips if kv_shards is None else kv_shards
    free = chip.hbm_bytes - reserved_bytes / n_chips - params * bytes_per_param / n_chips
    if free <= 0:
        return 0
    return int(free // (context * kv_bytes_per_token / kv_shards))
