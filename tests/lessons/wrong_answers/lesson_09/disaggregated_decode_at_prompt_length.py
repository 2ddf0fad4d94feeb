"""disaggregated_rates sizes the decode KV at the prompt length, forgetting the context grows while decoding."""
from tinyserve.roofline import DisaggregatedRates, decode_step_time, prefill_time

CAUGHT_BY = "disaggregated_rates"


def disaggregated_rates(chip, prefill_chips, decode_chips, prompt_len, output_len, decode_batch, params,
                        kv_bytes_per_token, bytes_per_param, link_bandwidth):
    step = decode_step_time(chip, decode_chips, decode_batch, params, prompt_len * kv_bytes_per_token,
                            bytes_per_param)
    return DisaggregatedRates(1 / prefill_time(chip, prefill_chips, prompt_len, params, bytes_per_param),
                              decode_batch / (step * output_len),
                              link_bandwidth / (prompt_len * kv_bytes_per_token))
