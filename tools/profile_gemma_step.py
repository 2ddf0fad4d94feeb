"""Where a decode step of a windowed model goes on the fast path (docs/sliding-window.md, "Where a Gemma decode step's
time goes"): per part, by CPU time and wall time, median over many steps.

B prompts of `--prompt` random tokens decode `--steps` tokens together through the paged Engine (what the benchmarks
run), on each path of `--paths` in turn (fused: kernels/block_layer.py's calls, the default path; tiles: the
reference's steps over TileMatrix). Around every part of each step a timer reads both clocks:
- layers' matmuls: tiles, every TileMatrix product of the layers (activation quantisation + the tile); fused, the
  four block_layer calls a layer (their norms, RoPE and activation included); regions, block_decode's two regions
  a layer (the same, plus the last layer's down matmul, which shares the head's region); layer, block_decode's
  one region a layer (the same with the K/V write and attention inside: the forward gets the Engine's KVLayout);
- LM head: the final norm and the [R, D] x [D, V] product (regions: with the last layer's MLP down half);
- attention: the strategy's attention function (K/V write + the paged Numba kernel, masked by window);
- the rest of the forward: what else the forward does (NumPy calls, Python);
- outside the forward: scheduling, sampling over [B, V] logits, bookkeeping (Engine.step minus the forward).
CPU time is time.process_time (every thread of the process). With two threads on a shared machine it mostly counts
the joins' waits for a partner thread that has no core; with NUMBA_NUM_THREADS=1 it is each part's work, which a
neighbour cannot inflate. Each part's per-step total is kept, and the table prints the medians over the steps (the
medians need not add up to the step's median).

    NUMBA_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python tools/profile_gemma_step.py --batch 1 16 --paths fused tiles
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARTS = ("layers' matmuls", "LM head", "attention", "rest of the forward", "outside the forward", "whole step")


class Clock:
    """Per-part totals of the current step, both clocks; `close_step` files them and starts the next step."""

    def __init__(self):
        self.cur = defaultdict(lambda: [0.0, 0.0])           # part -> [cpu s, wall s] in this step
        self.steps: list[dict] = []

    @contextmanager
    def part(self, name):
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            yield
        finally:
            acc = self.cur[name]
            acc[0] += time.process_time() - c0
            acc[1] += time.perf_counter() - w0

    def close_step(self):
        self.steps.append(dict(self.cur))
        self.cur.clear()


def instrument(clock: Clock, vocab: int):
    """Wrap the fast path's parts with the clock (monkeypatching: the engine itself is untouched)."""
    from tinyserve.kernels import block_forward as bf, block_layer

    rmatmul = bf.TileMatrix.__rmatmul__

    def timed_rmatmul(self, x):                            # the reference's steps over the tiles
        with clock.part("LM head" if self.shape[1] == vocab else "layers' matmuls"):
            return rmatmul(self, x)
    bf.TileMatrix.__rmatmul__ = timed_rmatmul
    for name in ("pre_attention", "post_attention", "act_input", "mlp_down"):   # the fused calls
        setattr(bf.block_layer, name, timed(clock, "layers' matmuls", getattr(block_layer, name)))
    bf.lm_head = timed(clock, "LM head", bf.lm_head)
    from tinyserve.kernels import block_decode                  # the regions (B below 32 rows, the default path)
    region_a = block_decode.region_a

    def timed_region_a(*a):                                    # split False: the last layer's tail and the head
        with clock.part("layers' matmuls" if a[14] else "LM head"):
            return region_a(*a)
    block_decode.region_a = timed_region_a
    block_decode.region_b = timed(clock, "layers' matmuls", block_decode.region_b)
    block_decode.region_layer = timed(clock, "layers' matmuls", block_decode.region_layer)   # attention included
    whole = bf.block_forward

    def timed_forward(model, tokens, positions, attention, logit_rows=None, kv_layout=None):
        with clock.part("forward"):
            return whole(model, tokens, positions, timed(clock, "attention", attention), logit_rows,
                         kv_layout if KEEP_LAYOUT[0] else None)
    bf.block_forward = timed_forward


KEEP_LAYOUT = [True]     # False: the forward is not told where the K/V live (two regions a layer)


def timed(clock: Clock, part: str, fn):
    def call(*a, **k):
        with clock.part(part):
            return fn(*a, **k)
    return call


def profile(model, clock: Clock, batch: int, prompt_len: int, steps: int, seed: int = 0) -> dict:
    from tinyserve.engine import Engine
    from tinyserve.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(1000, 200000, prompt_len)] for _ in range(batch)]
    bs = 16
    engine = Engine(model, num_blocks=batch * (-(-(prompt_len + steps + 2) // bs) + 1), block_size=bs,
                    max_batch_tokens=max(256, batch * prompt_len), max_running=batch)
    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 1, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    engine.step()                                          # the prefill step: not timed
    engine.step()                                          # one decode step to warm up
    clock.cur.clear()
    clock.steps.clear()
    while engine.has_unfinished():
        with clock.part("whole step"):
            engine.step()
        clock.close_step()
    return {"steps": len(clock.steps), "rows": medians(clock)}


def profile_prefill(model, clock: Clock, prompt_len: int, rounds: int, seed: int = 0) -> dict:
    """One prompt of prompt_len tokens prefilled in one step (one chunk, as bench_peers' prefill), `rounds` times,
    each on a fresh engine; the first is a warm-up."""
    from tinyserve.engine import Engine
    from tinyserve.sampling import SamplingParams

    prompt = [int(t) for t in np.random.default_rng(seed).integers(1000, 200000, prompt_len)]
    params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    clock.cur.clear()
    clock.steps.clear()
    for _ in range(rounds + 1):
        engine = Engine(model, num_blocks=-(-prompt_len // 16) + 2, block_size=16, max_batch_tokens=prompt_len,
                        max_running=1)
        engine.add_request(prompt, params)
        with clock.part("whole step"):
            engine.step()
        clock.close_step()
    clock.steps.pop(0)
    return {"steps": len(clock.steps), "rows": medians(clock)}


def medians(clock: Clock) -> dict:
    rows = {}
    for part in PARTS:
        vals = []
        for s in clock.steps:
            get = lambda name: s.get(name, [0.0, 0.0])     # noqa: E731
            if part == "rest of the forward":
                f = s.get("forward", [0.0, 0.0])
                v = [f[i] - get("layers' matmuls")[i] - get("LM head")[i] - get("attention")[i] for i in (0, 1)]
            elif part == "outside the forward":
                f = s.get("forward", [0.0, 0.0])
                v = [get("whole step")[i] - f[i] for i in (0, 1)]
            else:
                v = get(part)
            vals.append(v)
        rows[part] = (statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="weights/gemma3-270m/gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence (32, as bench_peers)")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    ap.add_argument("--paths", nargs="+", default=["layer"], choices=["layer", "regions", "fused", "tiles"],
                    help="layer: kernels/block_decode.py's one region a layer, attention inside (the default below "
                         "32 rows); regions: its two regions a layer, attention between them; fused: "
                         "kernels/block_layer.py's calls; tiles: the reference's steps over the tiles")
    ap.add_argument("--planes", type=int, nargs="+", default=[2], choices=[1, 2],
                    help="the int8 planes of gate|up's input (quant.two_planes) on the fused, regions and layer paths, "
                         "in turn: 2 as the model packs them (Gemma 3: a second one for up), 1 none; 1 against 2 "
                         "weighs the second plane's work")
    ap.add_argument("--prefill", type=int, default=0,
                    help="profile a prefill of this many tokens instead (one chunk; --steps rounds)")
    args = ap.parse_args(argv)

    import tinyserve as ts
    from tinyserve.backend import prepare
    from tinyserve.measure import cpu_info, git_commit

    from tinyserve.kernels import block_forward as bf

    model = prepare(ts.load_model(args.model, quant=args.quant, backend="numba"))
    tiles = bf.prepare(model, fuse=False) if "tiles" in args.paths else None
    packed = {"layer": model.fast, "regions": model.fast, "fused": model.fast, "tiles": tiles}
    cpu = cpu_info()
    print(f"{Path(args.model).name}, quant {model.quant}; {cpu['model']} ({', '.join(cpu['flags'])}); "
          f"commit {git_commit()}")
    clock = Clock()
    instrument(clock, model.config.vocab_size)
    own_planes = [(w.plane_lo, w.plane_hi) for w in model.fast.fused]

    def runs():                                            # (path, planes), interleaved as given
        for path in args.paths:
            for p in args.planes:
                model.fast = packed[path]
                if model.fast.fused is not None:
                    for w, own in zip(model.fast.fused, own_planes):
                        w.plane_lo, w.plane_hi = own if p == 2 else (0, 0)
                yield f"{path}, {p} plane{'s' * (p > 1)}"
    if args.prefill:
        for path in runs():
            res = profile_prefill(model, clock, args.prefill, args.steps)
            step_cpu, step_wall = res["rows"]["whole step"]
            print(f"\nprefill {args.prefill}, {path}: median ms of {res['steps']} rounds (CPU time of both threads "
                  "| wall)")
            print("| part | CPU ms | share of CPU | wall ms | share of wall |\n|---|---:|---:|---:|---:|")
            for part in PARTS:
                c, w = res["rows"][part]
                print(f"| {part} | {c * 1e3:.2f} | {c / step_cpu:.0%} | {w * 1e3:.2f} | {w / step_wall:.0%} |")
            print(f"(prefill {args.prefill}, {path}: {args.prefill / step_wall:.1f} tokens/s from the median wall)")
        return
    for B in args.batch:
        for path in runs():                                # interleaved: the same load on both, as far as it goes
            bf._regions_disabled = None if path.startswith(("layer", "regions")) else f"the {path} path is profiled"
            KEEP_LAYOUT[0] = path.startswith("layer")
            res = profile(model, clock, B, args.prompt, args.steps)
            step_cpu, step_wall = res["rows"]["whole step"]
            print(f"\nB={B}, {path}: {res['steps']} decode steps after a {args.prompt}-token prompt; median ms per "
                  f"step (CPU time of both threads | wall)")
            print("| part | CPU ms | share of CPU | wall ms | share of wall |\n|---|---:|---:|---:|---:|")
            for part in PARTS:
                c, w = res["rows"][part]
                print(f"| {part} | {c * 1e3:.2f} | {c / step_cpu:.0%} | {w * 1e3:.2f} | {w / step_wall:.0%} |")
            print(f"(B={B}, {path}: {B / step_wall:.1f} tokens/s from the median step's wall time)")


if __name__ == "__main__":
    main()
