"""The `generate` command: one prompt in, its answer streamed out, then one summary line (or one JSON object).

`python -m tinyserve generate` hands its parsed options to `main` here, as `chat` hands them to chat.py: check the
request, load the model on the path asked for, get the kernels (loaded, compiled, or compiling meanwhile: jit.py),
wire speculation (lesson 6) into the strategy, stream the answer, and say where the time went.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass

from .backend import runs_on_kernels, step_threads
from .cli_options import (add_backend_options, add_model_options, add_speculative_options, describe_backend,
                          draft_model_for, is_tiny, load_for_cli)

T_START = time.time()   # when this process started (as good as): the origin of generate's JSON timeline


def strategies() -> dict:
    """Name -> generate_stream(model, ids, max_new_tokens, params, tokenizer) yielding token ids."""
    # Imported here, not at the top, so `weights` and argument errors answer without loading numba; an import
    # error in one of these is a bug to see, not a strategy to drop quietly.
    from . import engine, kv_cache, naive
    return {"naive": naive.generate_stream, "kv": kv_cache.generate_stream, "paged": engine.generate_stream}


def default_strategy() -> str:
    return "kv"


def main(args) -> int:
    """`python -m tinyserve generate` (see __main__.py for the options): check the request, load, get the kernels,
    wire speculation, stream the answer, report."""
    params, strategy, prompt = check_generate_args(args)       # 1. bad input answers before anything loads
    tok, model = load_for_cli(args)                             # 2. weights, quantisation, backend
    from .tokenizer import prompt_ids                           # (loaded with the tokenizer: not before)
    ids = prompt_ids(tok, tok.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat else prompt)
    model, kernels = kernels_for(args, model, ids, strategy)    # 3. loaded, compiled, or compiling meanwhile
    generate_stream, spec = with_speculation(args, strategy, model, strategies()[strategy])   # 4. lesson 6
    answer = stream_answer(args, model, ids, generate_stream, params, tok, kernels)         # 5. timed
    after_answer(args, answer, model, kernels)                  # 6. the compile: left running, or finished
    path = model if kernels is None else kernels.fast           # the path asked for (the stand-in only stood in)
    if args.json:                                               # 7. one JSON object, or the summary line
        print(json.dumps(answer_json(args, strategy, path, tok, answer, kernels, spec), allow_nan=False))
    else:
        if not answer.ended:
            print(answer.stream.flush())
        print(f"\n[{strategy}, {describe_backend(path)}: {len(ids)} prompt tokens, {len(answer.out)} new; "
              f"{timing_summary(kernels, answer.stamps, answer.n_slow, answer.fast)}{spec_summary(args, spec)}]",
              file=sys.stderr)
    return 0


def check_generate_args(args):
    """(SamplingParams, strategy name, prompt text), or a ValueError that says what is wrong."""
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
    if args.speculative and is_tiny(args):
        raise ValueError("--speculative needs the real model (its drafters load SmolLM2's weights)")
    if args.speculative and strategy not in ("kv", "paged"):
        raise ValueError(f"--speculative works with --strategy kv or paged, not {strategy!r}")
    return params, strategy, prompt


def kernels_for(args, model, ids: list[int], strategy: str):
    """Lesson 7: (the model to run, jit.Kernels or None). The kernels are loaded or compiled before the clock starts.
    Cold, the kv and naive strategies answer on the NumPy path while a child process compiles, and switch between
    two tokens (jit.py); the others (and --compile wait) compile here first, announced."""
    from . import jit
    from .model import check_token_ids
    if not runs_on_kernels(model):
        return model, None
    check_token_ids(model.config, ids)     # before any compile starts: bad input answers at once, alone
    background = args.compile != "wait" and strategy in ("kv", "naive") and not args.speculative
    return jit.prepare(model, jit.workload_for(strategy), background, log=_log)


def with_speculation(args, strategy: str, model, generate_stream):
    """Lesson 6: the strategy's generate_stream with --speculative's drafter wired in, and its SpecStats (or None)."""
    if not args.speculative:
        return generate_stream, None
    from . import engine, speculative
    from .drafters import make_drafter
    spec = speculative.SpecStats()
    draft_model = draft_model_for(args.speculative, args.model)
    if strategy == "kv":
        drafter = make_drafter(args.speculative, model, draft_model)
        return (lambda m, i, n, p, t: speculative.generate_stream(  # noqa: E731
            m, i, n, p, t, drafter=drafter, k=args.draft_k, adaptive=args.adaptive_k, stats=spec)), spec
    return (lambda m, i, n, p, t: engine.generate_stream(  # noqa: E731
        m, i, n, p, t, speculative=args.speculative, draft_k=args.draft_k, adaptive_k=args.adaptive_k,
        draft_model=draft_model, spec_stats=spec)), spec


def add_arguments(g: argparse.ArgumentParser) -> None:
    """generate's options (__main__.build_parser)."""
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
    g.add_argument("--compile", default="background", choices=["background", "wait", "finish"],
                   help="first run (empty Numba cache): answer on the NumPy path while the kernels compile in the "
                        "background and return when the answer is done (default; the compile goes on, its log "
                        "named), compile first (wait), or answer meanwhile, then finish the compile and time the "
                        "fast path on the same tokens (finish); none is counted in TTFT or tokens/s")
    add_speculative_options(g)


@dataclass(slots=True)
class Answer:
    """One generated answer as the summary needs it."""
    stream: object                 # the tokenizer's StreamDecoder (what is not printed yet)
    ids: list[int]                 # the prompt's token ids
    out: list[int]                 # the new token ids
    stamps: list[float]            # the model's clock at each token (time spent loading kernels taken out)
    timeline: dict                 # seconds since the process started: ready, first_token, answer_done, ...
    n_slow: int = 0                # tokens computed on the NumPy stand-in (all of them, unless it switched)
    fast: tuple | None = None      # --compile finish: the fast path's (TTFT, tokens/s) on the same tokens
    ended: bool = False            # its last characters and newline are printed already


def stream_answer(args, model, ids, generate_stream, params, tok, kernels) -> Answer:
    """Generate and print (unless --json), timing every token; between two tokens the stand-in may become the
    fast model (kernels.switch: a safe point, the next forward has not started)."""
    answer = Answer(tok.stream_decoder(), list(ids), [], [], {"ready": time.time() - T_START})
    paused = 0.0
    # on the numba path BLAS stays at one thread (kernels/__init__.py), and on the NumPy stand-in (jit.prepare)
    blas = contextlib.nullcontext() if kernels is None else step_threads("numba")
    t0 = time.perf_counter()
    try:
        with blas:
            for token in generate_stream(model, ids, args.max_new_tokens, params, tok):
                answer.stamps.append(time.perf_counter() - t0 - paused)
                answer.out.append(token)
                if not args.json:
                    print(answer.stream.push(token), end="", flush=True)
                if kernels is not None and kernels.bg is not None:
                    paused += kernels.switch(model, len(answer.out))
    except BaseException:
        if kernels is not None and kernels.bg is not None:
            kernels.bg.stop()
        raise
    answer.timeline |= {"first_token": answer.timeline["ready"] + answer.stamps[0],
                        "answer_done": time.time() - T_START}
    answer.n_slow = len(answer.out)
    return answer


def after_answer(args, answer: Answer, model, kernels) -> None:
    """A background compile the answer outran: by default leave it running, detached, and say where its log is (the
    next run starts on the fast path); --compile finish waits for it and times the fast path on the same tokens."""
    from . import jit
    if kernels is None or kernels.bg is None:
        return
    if kernels.switched_at is not None:
        answer.n_slow = kernels.switched_at
    elif args.compile == "finish":
        if not args.json:
            print(answer.stream.flush(), flush=True)
            answer.ended = True
        if not kernels.bg.done():
            _log("[the answer is done; the kernels are still compiling (first run only), so that the next run "
                 "starts on the fast path:]")
        kernels.bg.wait(log=lambda line: _log(f"  {line}"))
        kernels.switch(model, len(answer.out))
        if kernels.switched_at is not None:
            answer.fast = jit.replay(model, list(answer.ids), answer.out)
            answer.timeline["replayed"] = time.time() - T_START
    elif not kernels.bg.done():
        if not args.json:
            print(answer.stream.flush(), flush=True)
            answer.ended = True
        kernels.leave_compiling(_log)
    if kernels.bg.done() and kernels.bg.seconds is not None:
        kernels.seconds = kernels.bg.seconds
    if kernels.seconds is not None:
        answer.timeline |= {"compile_started": kernels.bg.started - T_START,
                            "compiled": kernels.bg.started + kernels.seconds - T_START}


def answer_json(args, strategy, model, tok, answer: Answer, kernels, spec) -> dict:
    """--json: the answer, its timing and where the time went. No rate after a single token: null (NaN is not JSON)."""
    out, stamps = answer.out, answer.stamps
    ttft, total = stamps[0], stamps[-1]
    rate = (len(out) - 1) / (total - ttft) if len(out) > 1 and total > ttft else None
    return ({"strategy": strategy, "quant": model.quant, "backend": model.backend, "prompt_ids": answer.ids,
             "output_ids": out, "text": tok.decode(out, skip_special_tokens=True), "ttft_s": ttft,
             "tokens_per_s": rate, "total_s": total, "timeline_s": answer.timeline}
            | ({"kernels": kernels_json(kernels, answer.n_slow, answer.fast)} if kernels is not None else {})
            | ({"speculative": args.speculative,   # None, not NaN, when nothing was drafted
                "draft_alpha": spec.alpha if spec.accepted + spec.rejected else None,
                "tokens_per_step": spec.tokens_per_step if spec.steps else None} if spec is not None else {}))


def spec_summary(args, spec) -> str:
    if spec is None:
        return ""
    if not spec.steps:                      # the prompt's prefill gives the first token; it was the only one
        return f"; {args.speculative}: no verify step ran (the prefill gave the only new token)"
    alpha = f"α {spec.alpha:.2f}" if spec.accepted + spec.rejected else "nothing drafted"
    return f"; {args.speculative} drafts: {alpha}, {spec.tokens_per_step:.2f} tokens per forward"


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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
    if kernels.seconds is not None:
        took = f"compiled in the background in {kernels.seconds:.1f} s, first run only"
    elif not kernels.bg.done():
        took = f"still compiling, first run only; log: {kernels.bg.log_path}"
    else:
        took = f"the background compile failed: see {kernels.bg.log_path}"
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
