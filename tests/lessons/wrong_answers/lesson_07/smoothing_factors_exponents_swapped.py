"""smoothing_factors with the roles of the two maxima swapped (s grows with the weights' range): the outliers get
worse, not better."""
import numpy as np

CAUGHT_BY = "smoothing_factors"


def smoothing_factors(x_amax, w_amax, alpha=0.5):
    ok = (x_amax > 0) & (w_amax > 0)
    s = np.ones(x_amax.shape, np.float64)
    s[ok] = w_amax[ok].astype(np.float64) ** alpha / x_amax[ok].astype(np.float64) ** (1 - alpha)
    return s.astype(np.float32)
