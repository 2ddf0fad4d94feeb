"""critical_batch for MoE divides by n_experts / experts_per_token instead of multiplying."""
CAUGHT_BY = "critical_batch"


def critical_batch(chip, bytes_per_param, n_experts=1, experts_per_token=1):
    return chip.flops * bytes_per_param / (2 * chip.hbm_bandwidth) * experts_per_token / n_experts
