"""tinyserve: a from-scratch LLM inference engine in NumPy, built one lesson at a time."""
from .config import ModelConfig
from .model import Model, forward
from .weights import WeightsError, fetch_weights, load_model, tiny_model

__all__ = ["ModelConfig", "Model", "forward", "WeightsError", "fetch_weights", "load_model", "tiny_model"]
