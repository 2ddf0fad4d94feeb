"""apply_mask multiplies the logits by the mask: disallowed tokens get logit 0, allowed ones keep theirs."""
import numpy as np

CAUGHT_BY = "apply_mask"


def apply_mask(logits, allowed):
    return logits * allowed
