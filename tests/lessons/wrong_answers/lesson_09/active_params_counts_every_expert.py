"""ModelShape.active_params counts all n_experts MLPs, as if every token used every expert."""
from tinyserve.roofline import ModelShape as _Reference

CAUGHT_BY = "ModelShape"


class ModelShape(_Reference):
    __slots__ = ()

    def active_params(self):
        return self.params()
