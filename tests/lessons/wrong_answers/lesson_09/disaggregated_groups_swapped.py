"""disaggregated_rates gives the decode group the prefill group's chips (and the other way round): the same for a
16 + 16 deployment, wrong for any other split."""
from tinyserve.roofline import DisaggregatedRates, decode_step_time, prefill_time

CAUGHT_BY = "disaggregated_rates"


def disaggregated_rates(chip, prefill_chips, decode_chips, prompt_len, output_len, decode_batch, params,
                        kv_bytes_per_token, bytes_per_param, link_bandwidth):
    prefill = 1.0 / prefill_time(chip, decode_chips, prompt_len, params, bytes_per_param)
    step = decode_step_time(chip, prefill_chips, decode_batch, params, (prompt_len + output_len / 2) * kv_bytes_per_token,
                            bytes_per_param)
    decode = decode_batch / (step * output_len)
    handover = link_bandwidth / (prompt_len * kv_bytes_per_token)
    return DisaggregatedRates(prefill, decode, handover)
