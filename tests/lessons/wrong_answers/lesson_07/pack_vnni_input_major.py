"""pack_vnni puts the 4 inputs of a step outer and the 16 outputs inner (byte 16*k + l instead of 4*l + k): the
right bytes in the wrong order for vpdpbusd, which sums 4 consecutive bytes into one output lane."""
import numpy as np

CAUGHT_BY = "pack_vnni"


def pack_vnni(wq):
    D, O = wq.shape
    if D % 4 or O % 16:
        raise ValueError(f"pack_vnni needs D % 4 == 0 and O % 16 == 0, got a [{D}, {O}] matrix")
    w = wq.reshape(D // 4, 4, O // 16, 16)                 # [i, k, b, l]
    return np.ascontiguousarray(w.transpose(2, 0, 1, 3)).reshape(O // 16, D // 4 * 64)
