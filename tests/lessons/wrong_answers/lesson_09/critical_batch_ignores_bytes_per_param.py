"""critical_batch is FLOP/s over bandwidth, whatever the weights' precision (int8 would not halve it)."""
CAUGHT_BY = "critical_batch"


def critical_batch(chip, bytes_per_param, n_experts=1, experts_per_token=1):
    return chip.flops / chip.hbm_bandwidth * n_experts / experts_per_token
