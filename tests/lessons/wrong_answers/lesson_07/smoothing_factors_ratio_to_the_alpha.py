"""smoothing_factors as (x_amax / w_amax) ** alpha: the same as SmoothQuant's formula at alpha = 0.5 (the value
everyone tries first), another one at every other alpha."""
import numpy as np

CAUGHT_BY = "smoothing_factors"


def smoothing_factors(x_amax, w_amax, alpha=0.5):
    ok = (x_amax > 0) & (w_amax > 0)
    s = np.ones(x_amax.shape, np.float64)
    s[ok] = (x_amax[ok].astype(np.float64) / w_amax[ok]) ** alpha
    return s.astype(np.float32)
