"""PyTorch + Hugging Face transformers as a peer: greedy decode and prefill on tinyserve's own float32 tensors.

    .venv-ref/bin/python tools/peers/torch_worker.py --weights weights/smollm2-135m-instruct --threads 2

Runs in the torch venv (tinyserve never imports torch) and speaks tools/peers/protocol.py on stdin/stdout.
`LlamaForCausalLM` loads weights/smollm2-135m-instruct (model.safetensors with Hugging Face names + config.json,
written by `make weights`): the very tensors tinyserve multiplies, in float32.

The loops mirror what `model.generate` does for greedy search, without its per-step bookkeeping: one forward over
the prompt with a fresh DynamicCache and `logits_to_keep=1` (the LM head runs on the last position only, as in
generate), then one forward of one token per sequence per step reusing the cache; argmax on the last logits.
"""
from __future__ import annotations

import argparse
import time

from protocol import serve


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    return serve(lambda: load(args.weights, args.threads))


def load(weights: str, threads: int):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    model.eval()

    @torch.inference_mode()
    def forward(ids, cache):  # ids [B, m] -> next token ids [B] (greedy), the cache extended by m positions
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits  # [B, 1, V]
        return logits[:, -1].argmax(-1)

    def decode(prompts: list[list[int]], new_tokens: int) -> dict:
        """B equal-length prompts prefilled together (no padding needed), then new_tokens - 1 decode steps of
        one token per sequence. Only the decode steps are timed."""
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("the torch worker batches equal-length prompts only (no padding / attention mask)")
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        tok = forward(torch.tensor(prompts), cache)                                       # [B]
        prefill_s = time.perf_counter() - t0
        out = [tok]
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            tok = forward(tok[:, None], cache)                                            # [B, 1] -> [B]
            out.append(tok)
        decode_s = time.perf_counter() - t0
        tokens = torch.stack(out, dim=1).tolist()                                          # [B, new_tokens]
        return {"tokens": tokens, "decode_seconds": decode_s, "decode_tokens": len(prompts) * (new_tokens - 1),
                "prefill_seconds": prefill_s}

    def prefill(ids: list[int]) -> dict:
        """One prompt, one forward, logits of the last position only (logits_to_keep=1); timed to that token."""
        x = torch.tensor([ids])
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        tok = forward(x, cache)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "next_token": int(tok[0])}

    info = {"engine": "PyTorch", "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "weights": weights, "dtype": "float32",
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "mkldnn": torch.backends.mkldnn.is_available()}
    return info, {"decode": decode, "prefill": prefill}


if __name__ == "__main__":
    raise SystemExit(main())
