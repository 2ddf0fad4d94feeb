"""ModelShape.params counts W_k and W_v as wide as the query heads (forgets GQA's K < N)."""
from tinyserve.roofline import ModelShape as _Reference

CAUGHT_BY = "ModelShape"


class ModelShape(_Reference):
    __slots__ = ()

    def attention_params(self):
        return 4 * self.d_model * self.n_heads * self.head_dim
