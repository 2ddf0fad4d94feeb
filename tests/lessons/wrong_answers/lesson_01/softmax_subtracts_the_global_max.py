"""softmax subtracts the max of the whole array, not of each row: a row far below the largest one underflows to 0/0."""
import numpy as np

CAUGHT_BY = "softmax"


def softmax(x, axis=-1):
    e = np.exp(x - np.max(x))
    return e / np.sum(e, axis=axis, keepdims=True)
