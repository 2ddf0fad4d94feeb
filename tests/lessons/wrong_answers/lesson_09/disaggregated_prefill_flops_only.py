"""disaggregated_rates times a prefill by its FLOPs alone, forgetting that a prompt still reads every weight once:
the same for an 8192-token prompt (compute-bound), too fast for a short one (memory-bound)."""
from tinyserve.roofline import DisaggregatedRates, decode_step_time

CAUGHT_BY = "disaggregated_rates"


def disaggregated_rates(chip, prefill_chips, decode_chips, prompt_len, output_len, decode_batch, params,
                        kv_bytes_per_token, bytes_per_param, link_bandwidth):
    prefill = prefill_chips * chip.flops / (2 * params * prompt_len)
    step = decode_step_time(chip, decode_chips, decode_batch, params, (prompt_len + output_len / 2) * kv_bytes_per_token,
                            bytes_per_param)
    decode = decode_batch / (step * output_len)
    handover = link_bandwidth / (prompt_len * kv_bytes_per_token)
    return DisaggregatedRates(prefill, decode, handover)
