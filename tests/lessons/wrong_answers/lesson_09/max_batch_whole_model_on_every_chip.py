"""max_batch puts the whole model on every chip instead of 1/n_chips of it."""
CAUGHT_BY = "max_batch"


def max_batch(chip, n_chips, context, params, kv_bytes_per_token, bytes_per_param, reserved_bytes=0,
              kv_shards=None):
    kv_shards = n_chips if kv_shards is None else kv_shards
    free = chip.hbm_bytes - reserved_bytes - params * bytes_per_param
    return max(0, int(free // (context * kv_bytes_per_token / kv_shards)))
