"""ik_llama.cpp as a peer: greedy decode and prefill through ik-llama-cpp-python's ctypes API, with ik's CPU settings.

    .venv-ik/bin/python tools/peers/ik_worker.py --gguf SmolLM2-135M-Instruct.Q4_0.gguf --threads 2

Runs in .venv-ik (tools/peers/setup_ik.sh, a native build of the ik_llama.cpp that the ik-llama-cpp-python sdist
vendors) and speaks tools/peers/protocol.py on stdin/stdout; the timed loops are llama_worker.py's
(greedy_loop.py). What ik adds over mainline on a CPU, and what this worker turns on by default:

    run-time repacking   llama_model_params.repack_tensors (llama-bench's -rtr): Q4_0, Q8_0, IQ4_NL, IQ4_KS ... are
                         rewritten at load into ik's row-interleaved layouts (Q4_0_R8, Q8_0_R8, IQ4_NL_R4, ...), which
                         its GEMV and GEMM kernels read fastest. Model-wide: it needs a reload to change.
    flash attention      llama_context_params.flash_attn (-fa): ik's own CPU kernels (iqk_flash_attn.cpp).
    a q8_0 K/V cache     llama_context_params.type_k / type_v (-ctk / -ctv): half the bytes of f16 per cached
                         position, read by those flash-attention kernels.

One exception: in the ik_llama.cpp of ik-llama-cpp-python 0.1.5, flash attention over several sequences in one
batch aborts the process (an assertion in its batched path), so `--flash-attn auto` (the default) turns it on for
one sequence (decode B=1, prefill) and off for several (decode B=16). ik refuses a quantized V cache without flash
attention, so there V stays f16 and K keeps the --kv type. A second one: that version's run-time repacking of
IQ4_NL gives NaN logits on SmolLM2 (greedy token 0 everywhere; flash attention then aborts on them), so bench-peers
runs IQ4_NL and IQ4_KS (which falls back to IQ4_NL on rows of 576) with --no-repack.
"""
from __future__ import annotations

import argparse
import ctypes
from dataclasses import asdict, dataclass

from greedy_loop import greedy_commands, quiet_log
from protocol import serve

# ggml_type values of the K/V cache types offered here (ggml/include/ggml.h of the vendored ik_llama.cpp)
GGML_TYPES = {"f16": 1, "q8_0": 8}
FLASH_ATTN = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class IkSettings:
    repack: bool = True             # run-time repacking of the weights into ik's interleaved rows (-rtr)
    flash_attn: str = "auto"        # on | off | auto: on for one sequence, off for several (0.1.5 aborts there)
    kv: str = "q8_0"                # the K/V cache type (V stays f16 where flash attention is off)
    merge_qkv: bool = False         # Q, K and V in one matrix at load (ik's -mqkv)

    def uses_flash_attn(self, n_seq: int) -> bool:
        return self.flash_attn == "on" or (self.flash_attn == "auto" and n_seq == 1)

    def cache_types(self, n_seq: int) -> tuple[str, str]:
        """(K type, V type) of a context for n_seq sequences."""
        return self.kv, (self.kv if self.uses_flash_attn(n_seq) else "f16")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, IkSettings]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-repack", action="store_true", help="keep the GGUF's layout (no run-time repacking)")
    ap.add_argument("--flash-attn", choices=FLASH_ATTN, default="auto",
                    help="auto: on for one sequence, off for several (ik-llama-cpp-python 0.1.5 aborts there)")
    ap.add_argument("--kv", choices=sorted(GGML_TYPES), default="q8_0", help="the K/V cache type (q8_0)")
    ap.add_argument("--merge-qkv", action="store_true", help="merge Q, K and V into one matrix at load")
    args = ap.parse_args(argv)
    return args, IkSettings(repack=not args.no_repack, flash_attn=args.flash_attn, kv=args.kv,
                            merge_qkv=args.merge_qkv)


def main(argv: list[str] | None = None) -> int:
    args, settings = parse_args(argv)
    return serve(lambda: load(args.gguf, args.threads, settings))


def preload_ggml() -> None:
    """ik-llama-cpp-python's libllama.so needs libggml.so beside it but carries no rpath to find it there: load that
    one first, globally, so the dynamic linker reuses it for libllama.so."""
    import importlib.util
    import os
    spec = importlib.util.find_spec("ik_llama_cpp")
    if spec is None or spec.origin is None:
        raise RuntimeError("ik_llama_cpp is not installed in this venv: run tools/peers/setup_ik.sh")
    ctypes.CDLL(os.path.join(os.path.dirname(spec.origin), "lib", "libggml.so"), mode=ctypes.RTLD_GLOBAL)


def load(gguf: str, threads: int, settings: IkSettings):
    preload_ggml()
    import ik_llama_cpp
    from ik_llama_cpp import _ctypes_api as C

    lib = C._lib
    lib.llama_log_set.argtypes = [_LOG_CALLBACK_TYPE, ctypes.c_void_p]
    lib.llama_log_set.restype = None
    lib.llama_log_set(quiet_log(_LOG_CALLBACK_TYPE, _LOG_CALLBACK), None)   # its per-tensor lines bury warnings
    lib.llama_print_system_info.restype = ctypes.c_char_p
    C.llama_backend_init()
    mp = C.llama_model_default_params()
    mp.repack_tensors = settings.repack        # repacking reads the file into memory: ik turns mmap off for it
    mp.merge_qkv = settings.merge_qkv
    model = C.llama_model_load_from_file(gguf.encode(), mp)
    if not model:
        raise RuntimeError(f"ik_llama.cpp could not load {gguf}")
    n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
    contexts: dict[tuple[int, int, int], object] = {}

    def context(n_seq: int, positions_per_seq: int, n_batch: int):
        """A context whose KV cache holds n_seq sequences of positions_per_seq each, made once per shape."""
        per_seq = -(-positions_per_seq // 256) * 256          # ik pads the cache to 256 with flash attention
        key = (n_seq, per_seq, n_batch)
        if key not in contexts:
            p = C.llama_context_default_params()
            p.n_ctx = n_seq * per_seq
            p.n_batch = p.n_ubatch = max(512, n_batch)  # the whole prompt batch in one llama_decode
            p.n_seq_max = n_seq
            p.n_threads = p.n_threads_batch = threads
            p.flash_attn = settings.uses_flash_attn(n_seq)
            k, v = settings.cache_types(n_seq)
            p.type_k, p.type_v = GGML_TYPES[k], GGML_TYPES[v]
            ctx = C.llama_init_from_model(model, p)
            if not ctx:
                raise RuntimeError(f"ik_llama.cpp could not make a context for {n_seq} x {per_seq} positions "
                                   f"(flash_attn={bool(p.flash_attn)}, K {k}, V {v})")
            contexts[key] = ctx
        ctx = contexts[key]
        C.llama_kv_cache_clear(ctx)            # every measurement starts from an empty cache
        return ctx

    info = {"engine": "ik_llama.cpp", "ik_llama_cpp_python": ik_llama_cpp.__version__, "threads": threads,
            "gguf": gguf, "n_vocab": n_vocab, "settings": asdict(settings),
            "system_info": lib.llama_print_system_info().decode(errors="replace").strip()}
    return info, greedy_commands(C, n_vocab, context)


# ggml_log_callback: void (*)(enum ggml_log_level level, const char * text, void * user_data)
_LOG_CALLBACK_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_LOG_CALLBACK = []   # ctypes callbacks must outlive the C library's use of them


if __name__ == "__main__":
    raise SystemExit(main())
