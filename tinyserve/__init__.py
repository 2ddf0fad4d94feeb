"""tinyserve: a from-scratch LLM inference engine in NumPy, built one lesson at a time.

    import tinyserve as ts
    model = ts.load_model()                      # weights/smollm2-135m-instruct (make weights)
    tok = ts.load_tokenizer()
    ids = tok.encode_chat([{"role": "user", "content": "Hi!"}])
    out = ts.naive.generate(model, ids, max_new_tokens=32, params=ts.SamplingParams(temperature=0.0))  # lesson 1
    out = ts.kv_cache.generate(model, ids, 32, ts.SamplingParams(temperature=0.0))                    # lesson 2
    engine = ts.Engine(model, prefix_caching=True)                                                     # lessons 4-5
"""
from . import gqa, kv_cache, naive, roofline
from .config import ModelConfig
from .engine import Engine
from .model import Model, forward
from .sampling import SamplingParams
from .tokenizer import Tokenizer, load_tokenizer
from .weights import WeightsError, fetch_weights, load_model, tiny_model

__all__ = ["ModelConfig", "Model", "forward", "WeightsError", "fetch_weights", "load_model", "tiny_model",
           "SamplingParams", "Tokenizer", "load_tokenizer", "Engine", "naive", "kv_cache", "gqa", "roofline"]

# TINYSERVE_SOLUTION=learner: run the learner's implemented exercise functions instead of the reference (course.py)
from . import course as _course  # noqa: E402

_course.apply_env_switch()
