"""llama.cpp as a peer: greedy decode and prefill through llama-cpp-python's low-level C API.

    .venv-llama/bin/python tools/peers/llama_worker.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --threads 2

Runs in .venv-llama (tools/peers/setup_llama.sh) and speaks tools/peers/protocol.py on stdin/stdout. The model is
loaded once; a context (KV cache) is made once per batch shape and cleared before each measurement.

Why the low-level API: `llama_cpp.Llama` serves one sequence; B sequences decoding together need a `llama_batch`
with one seq_id per sequence, exactly as llama.cpp's own `batched` example does. Sampling is a NumPy argmax over
the logits row of each sequence (greedy), inside the timed loop, as in tinyserve's Engine step (greedy_loop.py,
shared with ik_worker.py).
"""
from __future__ import annotations

import argparse

from greedy_loop import greedy_commands, quiet_log
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

    # its debug lines (thousands per context) would bury the warnings
    C.llama_log_set(quiet_log(C.llama_log_callback, _LOG_CALLBACK), None)
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

    info = {"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "threads": threads, "gguf": gguf,
            "n_vocab": n_vocab, "system_info": C.llama_print_system_info().decode(errors="replace").strip()}
    return info, greedy_commands(C, n_vocab, context)


_LOG_CALLBACK = []   # ctypes callbacks must outlive the C library's use of them


if __name__ == "__main__":
    raise SystemExit(main())
