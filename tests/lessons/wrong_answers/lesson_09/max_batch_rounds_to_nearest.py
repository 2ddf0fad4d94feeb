"""max_batch rounds to the nearest integer: 6.9 sequences become 7, and the seventh does not fit."""
CAUGHT_BY = "max_batch"


def max_batch(chip, n_chips, context, params, kv_bytes_per_token, bytes_per_param, reserved_bytes=0,
              kv_shards=None):
    kv_shards = n_chips if kv_shards is None else kv_shards
    free = chip.hbm_bytes - reserved_bytes - params * bytes_per_param / n_chips
    return max(0, round(free / (context * kv_bytes_per_token / kv_shards)))
