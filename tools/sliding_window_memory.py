"""Lesson 11 / docs/sliding-window.md: the K/V memory of one long conversation, with and without the window.

Predicted for Gemma 3 270M's shape (kv_sizing.paged_kv_bytes), then counted: the paged Engine runs a random tiny model
with Gemma's layer pattern (18 layers, every sixth global, window 512) through the same number of positions, and
the block manager's allocators say how many blocks each layer kind holds; times Gemma's bytes per block and layer.

    PYTHONPATH=. .venv/bin/python tools/sliding_window_memory.py [--positions 4096] [--block-size 16]
"""
from __future__ import annotations

import argparse
import time

from tinyserve.config import ModelConfig
from tinyserve.engine import Engine
from tinyserve.kv_sizing import paged_kv_bytes
from tinyserve.sampling import SamplingParams
from tinyserve.weights import tiny_model

GEMMA3_270M = ModelConfig(dim=640, n_layers=18, n_heads=4, n_kv_heads=1, intermediate_size=2048,
                          vocab_size=262144, max_seq_len=32768, rope_theta=1e6, key_length=256,
                          sliding_window=512, sliding_window_pattern=6, rope_theta_local=1e4)


def count(positions: int, block_size: int, free: bool) -> tuple[int, int, float]:
    """Blocks the engine's two pools hold (global, local) once `positions` positions are in, on the tiny model."""
    model = tiny_model(n_layers=18, max_seq_len=positions + 8, sliding_window=512, sliding_window_pattern=6)
    engine = Engine(model, num_blocks=positions // block_size + 8, block_size=block_size, max_batch_tokens=512)
    engine.blocks.free_behind_window = free
    engine.add_request([3 + i % 250 for i in range(positions)], SamplingParams(temperature=0, max_new_tokens=2,
                                                                               ignore_eos=True))
    t0 = time.perf_counter()
    held = (0, 0)
    while engine.has_unfinished():
        engine.step()
        seq = engine.running[0] if engine.running else None
        if seq is not None and seq.num_computed_tokens == positions:   # the whole conversation is in the cache
            held = (engine.blocks.allocator.num_used, engine.blocks.local.num_used)
    return held[0], held[1], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    n, bs, cfg = args.positions, args.block_size, GEMMA3_270M
    per_block = 2 * bs * cfg.n_kv_heads * cfg.head_dim * 4          # one layer's K and V of one block, float32
    n_local = sum(cfg.layer_window(i) is not None for i in range(cfg.n_layers))
    print(f"Gemma 3 270M shape: {cfg.n_layers} layers ({n_local} local, window {cfg.sliding_window}), "
          f"K={cfg.n_kv_heads} x H={cfg.head_dim}, float32: {per_block // bs} bytes per position and layer; "
          f"{n} positions, blocks of {bs}")
    print(f"{'':32}{'global MiB':>11}{'local MiB':>11}{'total MiB':>11}   counted blocks (global, local)")
    for free in (False, True):
        g, loc = paged_kv_bytes(cfg, n, bs, free_behind_window=free)
        cg, cl, secs = count(n, bs, free)
        counted = ((cfg.n_layers - n_local) * cg * per_block, n_local * cl * per_block)
        name = "window frees blocks" if free else "every block kept"
        for label, (a, b) in (("predicted", (g, loc)), ("counted", counted)):
            print(f"{name + ', ' + label:32}{a / 2**20:11.1f}{b / 2**20:11.1f}{(a + b) / 2**20:11.1f}"
                  + (f"   {cg}, {cl} ({secs:.1f} s on the tiny model)" if label == "counted" else ""))


if __name__ == "__main__":
    main()
