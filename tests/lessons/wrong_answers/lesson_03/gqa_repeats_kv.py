"""grouped_attention copies K and V g times with np.repeat (correct numbers, but the copy lesson 3 is about removing)."""
from tinyserve.kv_cache import rectangular_attention

CAUGHT_BY = "grouped_attention"


def grouped_attention(q, k, v):
    return rectangular_attention(q, k, v)
