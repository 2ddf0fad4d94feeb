"""The command line's shared options: which path runs (lesson 7), speculation (lesson 6), the engine's size (lesson 4).

`generate`, `bench`, `chat` and `serve` take these flags from here, so a flag has one spelling, one default and one
way of becoming Model / Engine arguments in every command. __main__.py only assembles the parser; the commands'
modules import from here, never from __main__ (under `python -m` that would load a second copy of it).
"""
from __future__ import annotations

import argparse

from .quant import AUTO, INT8, QUANT_MODES, get_mode
from .weights import DEFAULT_WEIGHTS_DIR

# --- lesson 7: the backend and the quantisation --------------------------------------------------------------------
QUANTS = (AUTO, *QUANT_MODES)        # quant.py's registry: one spelling of every mode
TINY = "tiny"                        # --model tiny: the random tiny model, not a path


def add_backend_options(p: argparse.ArgumentParser) -> None:
    # auto by default: the fastest mode within int8's accuracy bounds on this CPU (backend.default_quant): W4A8 for
    # weights that are Q4_1 already (SmolLM2's: the model's own weights, 5 bits each) on the x86 variants, where it
    # decodes fastest, else W8A8-64 where the kernels have a byte dot product, else int8; lesson 7's tables measure
    # them
    p.add_argument("--quant", default=AUTO, choices=QUANTS,
                   help="quantisation (lesson 7; default auto: the fastest accurate mode on this CPU; int8: int8 "
                        "weights, float32 activations; w8a8-64: int8 activations too, one scale per 64 values; "
                        "w8a8: one scale per token, faster, less accurate; w4a8: the GGUF's own 4-bit weights (Q4_1), "
                        "int8 activations; none = float32, the reference)")
    p.add_argument("--backend", default="numba", choices=["numpy", "numba"],
                   help="numba: the fused kernels (default); numpy: the readable reference")


def add_model_options(p: argparse.ArgumentParser, tiny: bool = True) -> None:
    """--model PATH (--weights is the same option): the weights folder (or a .gguf file), or the name of a model
    `make weights MODEL=NAME` fetches (zoo.local_path), handed to weights.load_model and tokenizer.load_tokenizer;
    `--model tiny` where the command can run on the random tiny model."""
    extra = "; tiny: a random 2-layer model with a character tokenizer (tests; answers are noise)" if tiny else ""
    p.add_argument("--model", "--weights", dest="model", metavar="PATH", default=str(DEFAULT_WEIGHTS_DIR),
                   help=f"the model: a weights folder, a .gguf file, or a fetched model's name "
                        f"(smollm2-135m-instruct, gemma3-270m; default: {DEFAULT_WEIGHTS_DIR}){extra}")


def is_tiny(args) -> bool:
    """Does the command run on the random tiny model (`--model tiny`)?"""
    return getattr(args, "model", None) == TINY


def load_for_cli(args):
    """(tokenizer, model) for --model PATH (a weights folder or a .gguf file) or tiny (random, a character
    tokenizer)."""
    from .backend import set_backend
    if is_tiny(args):
        from .tokenizer import CharTokenizer
        from .weights import tiny_model
        return CharTokenizer(), set_backend(tiny_model(seed=0), args.quant, args.backend)
    from .tokenizer import load_tokenizer
    from .weights import load_model
    from .zoo import local_path        # a shipped model's name (gemma3-270m) or a path
    path = local_path(args.model)
    return load_tokenizer(path), load_model(path, quant=args.quant, backend=args.backend)


def describe_backend(model) -> str:
    """Which path runs (lesson 7): the fast one is the default, `--quant none --backend numpy` the reference."""
    what = get_mode(model.quant).label
    if model.backend != "numba":
        return f"{what}, {model.backend} backend"
    from .backend import describe_kernels     # which instruction set the kernels were built for (lesson 7)
    return f"{what}, {model.backend} backend, {describe_kernels()}"


# --- lesson 6: speculative decoding ----------------------------------------------------------------------------------
DRAFTERS = ("ngram", "early-exit", "int8")


def add_speculative_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative", default=None, choices=DRAFTERS,
                        help="lesson 6: draft tokens with this drafter and verify them in one forward of the model "
                             "(the output is unchanged; only the speed is)")
    parser.add_argument("--draft-k", type=int, default=4, help="tokens drafted per step (the maximum with --adaptive-k)")
    parser.add_argument("--adaptive-k", action="store_true",
                        help="pick k per step from the measured acceptance rate (roofline's expected-tokens formula)")


def draft_model_for(kind: str | None, weights):
    """The draft Model the drafter needs: the int8 copy of the target for "int8" (lesson 7's weights on its Numba
    kernels: the NumPy int8 reference is slower than the float32 target), else None."""
    if kind != INT8.name:                      # the drafter is named after the mode of its model
        return None
    from .weights import load_model
    return load_model(weights, quant=INT8.name, backend="numba")


def speculative_engine_kwargs(args, model) -> dict:
    """Engine(...) keyword arguments for the --speculative options ({} when off)."""
    kind = getattr(args, "speculative", None)
    if not kind:
        return {}
    return dict(speculative=kind, draft_k=args.draft_k, adaptive_k=args.adaptive_k,
                draft_model=draft_model_for(kind, args.model))


# --- lesson 4: the engine's size -------------------------------------------------------------------------------------
# One whole context window of SmolLM2 at the default block size (512 x 16 = 8192 positions): no command refuses a
# prompt the model could take, and the pool is ~0.4 GB of float32 K/V (30 layers x 3 KV heads x 64 x 2 x 4 bytes
# = 46 KB a position), touched only as far as it is used.
DEFAULT_NUM_BLOCKS = 512


def add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-blocks", type=int, default=DEFAULT_NUM_BLOCKS, help="KV pool size (x block size = positions)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=256, help="per-step token budget (chunked prefill)")
    p.add_argument("--max-running", type=int, default=64, help="most requests in one running batch")


def engine_kwargs(args, model) -> dict:
    """Engine(...) keyword arguments for the engine-size options, and the speculative ones where the command
    has them."""
    return dict(num_blocks=args.num_blocks, block_size=args.block_size, max_batch_tokens=args.max_batch_tokens,
                max_running=args.max_running, **speculative_engine_kwargs(args, model))
