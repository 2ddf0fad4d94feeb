"""llama.cpp as a peer: greedy decode and prefill through llama-cpp-python's low-level C API.

    .venv-llama/bin/python tools/peers/llama_worker.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --threads 2

Runs in .venv-llama (tools/peers/setup_llama.sh) and speaks tools/peers/protocol.py on stdin/stdout. The model is
loaded once; a context (KV cache) is made once per batch shape and cleared before each measurement.

Why the low-level API: `llama_cpp.Llama` serves one sequence; B sequences decoding together need a `llama_batch`
with one seq_id per sequence, exactly as llama.cpp's own `batched` example does. Sampling is a NumPy argmax over
the logits row of each sequence (greedy), inside the timed loop, as in tinyserve's Engine step.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from protocol import serve


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    return serve(lambda: load(args.gguf, args.threads))


def load(gguf: str, threads: int):
    import llama_cpp
    from llama_cpp import llama_cpp as C

    C.llama_log_set(_quiet_log(C), None)   # its debug lines (thousands per context) would bury the warnings
    C.llama_backend_init()
    model = C.llama_model_load_from_file(gguf.encode(), C.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
    contexts: dict[tuple[int, int], object] = {}

    def context(n_seq: int, positions_per_seq: int, n_batch: int):
        """A context whose KV cache holds n_seq sequences of positions_per_seq each, made once per shape."""
        per_seq = -(-positions_per_seq // 256) * 256          # llama.cpp pads context sizes to 256 anyway
        key = (n_seq, per_seq, n_batch)
        if key not in contexts:
            p = C.llama_context_default_params()
            p.n_ctx = n_seq * per_seq          # split evenly between the sequences (or shared when unified)
            p.n_batch = p.n_ubatch = max(512, n_batch)  # the whole prompt batch in one llama_decode
            p.n_seq_max = n_seq
            p.n_threads = p.n_threads_batch = threads
            ctx = C.llama_init_from_model(model, p)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not make a context for {n_seq} x {per_seq} positions")
            contexts[key] = ctx
        ctx = contexts[key]
        C.llama_memory_clear(C.llama_get_memory(ctx), True)   # every measurement starts from an empty cache
        return ctx

    def run_batch(ctx, batch, entries: list[tuple[int, int, int, bool]]) -> None:
        """Fill `batch` with (token, position, sequence, wants logits) entries and run llama_decode on it."""
        for i, (tok, pos, seq, logits) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = int(logits)
        batch.n_tokens = len(entries)
        rc = C.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(entries)} tokens")

    def next_token(ctx, i: int) -> int:
        """Greedy: argmax of the logits of batch entry i."""
        row = np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, i), shape=(n_vocab,))  # [V], no copy
        return int(row.argmax())

    def decode(prompts: list[list[int]], new_tokens: int) -> dict:
        """B prompts prefilled together, then new_tokens - 1 decode steps of B tokens each (one per sequence).
        Only the decode steps are timed: the first new token comes from the prefill's logits."""
        B = len(prompts)
        n_prompt = sum(map(len, prompts))
        ctx = context(B, max(map(len, prompts)) + new_tokens, n_prompt)
        batch = C.llama_batch_init(max(n_prompt, B), 0, 1)
        try:
            entries = [(t, j, b, j == len(p) - 1) for b, p in enumerate(prompts) for j, t in enumerate(p)]
            t0 = time.perf_counter()
            run_batch(ctx, batch, entries)
            last = np.cumsum([len(p) for p in prompts]) - 1                  # [B] batch index of each last token
            out = [[next_token(ctx, int(i))] for i in last]
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for step in range(new_tokens - 1):
                run_batch(ctx, batch, [(out[b][-1], len(p) + step, b, True) for b, p in enumerate(prompts)])
                for b in range(B):
                    out[b].append(next_token(ctx, b))
            decode_s = time.perf_counter() - t0
        finally:
            C.llama_batch_free(batch)
        return {"tokens": out, "decode_seconds": decode_s, "decode_tokens": B * (new_tokens - 1),
                "prefill_seconds": prefill_s}

    def prefill(ids: list[int]) -> dict:
        """One prompt in one llama_decode, logits for its last position only; timed up to that token."""
        ctx = context(1, len(ids), len(ids))
        batch = C.llama_batch_init(len(ids), 0, 1)
        try:
            entries = [(t, j, 0, j == len(ids) - 1) for j, t in enumerate(ids)]
            t0 = time.perf_counter()
            run_batch(ctx, batch, entries)
            tok = next_token(ctx, len(ids) - 1)
            seconds = time.perf_counter() - t0
        finally:
            C.llama_batch_free(batch)
        return {"seconds": seconds, "next_token": tok}

    info = {"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "threads": threads, "gguf": gguf,
            "n_vocab": n_vocab, "system_info": C.llama_print_system_info().decode(errors="replace").strip()}
    return info, {"decode": decode, "prefill": prefill}


_LOG_CALLBACK = []   # ctypes callbacks must outlive the C library's use of them


def _quiet_log(C):
    """A llama.cpp log callback that keeps warnings and errors (ggml levels WARN=3, ERROR=4) and drops the rest;
    level 5 (CONT) continues the previous message, so it follows that message's fate."""
    shown = [True]

    def log(level: int, text: bytes, _user_data) -> None:
        shown[0] = shown[0] if level == 5 else level >= 3
        if shown[0]:
            sys.stderr.write(text.decode(errors="replace"))

    _LOG_CALLBACK.append(C.llama_log_callback(log))
    return _LOG_CALLBACK[-1]


if __name__ == "__main__":
    raise SystemExit(main())
