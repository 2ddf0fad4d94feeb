"""Lesson 8: predict latency under load before measuring it — the roofline for one step, Little's law for many.

A decode step reads every weight once for the whole batch and each sequence's K/V once, so at small batch it is
memory-bound: t_step(B) ~ (weight bytes + B * context * KV bytes per token) / bandwidth. A prefill token costs
~2 * params FLOPs instead (compute-bound). Under a steady arrival rate lambda, Little's law L = lambda * W ties the
number of requests in the system (the batch B) to the time each spends there (W ~ TTFT + n_out * t_step(B)), and
t_step itself grows with B: the batch settles where both agree — or never does, when lambda * n_out * t_step(B)
outgrows B (the server is past its capacity and the queue grows without bound).

The interleaved design mixes prefill chunks into decode steps: `interleave_budget` is its per-step rule, and
`step_with_prefill` what it costs the running decodes (their inter-token latency).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .config import ModelConfig
from .roofline import kv_bytes_per_token


def num_parameters(config: ModelConfig) -> int:
    """Parameters of a LLaMA-style model with a tied embedding (the LM head reuses it): all of them are read by
    every decode step."""
    D, F, L = config.dim, config.intermediate_size, config.n_layers
    H, N, K, V = config.head_dim, config.n_heads, config.n_kv_heads, config.vocab_size
    per_layer = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F + 2 * D   # q, k+v, o, gate+up+down, 2 norms
    return V * D + L * per_layer + D


def decode_step_seconds(config: ModelConfig, batch: int, context: int, bandwidth: float,
                        bytes_per_weight: float = 4, bytes_per_kv: int = 4) -> float:
    """Memory-bound lower bound of one decode step: the weights once + every sequence's K/V once, / bandwidth."""
    moved = num_parameters(config) * bytes_per_weight + batch * context * kv_bytes_per_token(config, bytes_per_kv)
    return moved / bandwidth


def prefill_seconds_per_token(config: ModelConfig, flops_per_s: float) -> float:
    """Compute-bound cost of one prompt token: 2 FLOPs per parameter (attention over a short prompt is small)."""
    return 2 * num_parameters(config) / flops_per_s


def interleave_budget(num_decoding: int, prefill_remaining: Sequence[int], token_budget: int) -> tuple[int, list[int]]:
    """One interleaved step's token budget: who runs how many tokens.

    Decodes go first, one token each (a running request's next token should never wait behind someone's prompt;
    if the budget cannot cover them all, only the first `token_budget` run). What is left goes to the waiting
    prompts in arrival order, each taking up to what it still has to prefill: a long prompt is cut into chunks
    over several steps. Returns (decodes that run, [tokens for each prompt]) — the chunks sum to at most what
    is left of the budget, and a prompt gets tokens only if every prompt before it got all of its remainder.
    """
    decodes = min(num_decoding, token_budget)
    left = token_budget - decodes
    chunks = []
    for remaining in prefill_remaining:
        take = min(remaining, left)
        chunks.append(take)
        left -= take
    return decodes, chunks


def step_with_prefill(decode_step: float, prefill_tokens: int, prefill_per_token: float) -> float:
    """A step that carries a prefill chunk lasts about as long as the decode step plus the chunk's compute: every
    decode in that step waits this long for its next token (the interleaved design's ITL spike)."""
    return decode_step + prefill_tokens * prefill_per_token


@dataclass(frozen=True, slots=True)
class LoadPrediction:
    rate: float                # requests / s
    batch: float               # requests in the system (Little's L)
    step: float                # s per decode step at that batch
    ttft: float                # s: one step of wait (arrival is uniform within a step) + the prompt's prefill
    itl: float                 # s: one decode step
    stable: bool               # False: the rate exceeds what the server can drain; the queue grows forever

    @property
    def latency(self) -> float:  # W
        return self.batch / self.rate if self.rate else 0.0


def predict_load(rate: float, prompt_tokens: float, output_tokens: float, step_seconds: Callable[[float], float],
                 prefill_per_token: float, max_batch: float = 64, iters: int = 200) -> LoadPrediction:
    """Fixed point of Little's law: B = rate * W with W = TTFT + (output_tokens - 1) * t_step(B).

    step_seconds(B) is the decode step time at batch B (e.g. decode_step_seconds, or a measured fit). Stable when
    the iteration settles below max_batch; else the server is saturated (reported with stable=False, batch =
    max_batch: the queue, not the batch, absorbs the excess)."""
    b = 1.0
    for _ in range(iters):
        step = step_seconds(b)
        ttft = step / 2 + step + prompt_tokens * prefill_per_token
        w = ttft + (output_tokens - 1) * step
        nb = max(rate * w, 1e-9)
        if nb > max_batch:
            step = step_seconds(max_batch)
            return LoadPrediction(rate, max_batch, step, float("inf"), step, False)
        if abs(nb - b) < 1e-6:
            break
        b = 0.5 * (b + nb)
    step = step_seconds(b)
    return LoadPrediction(rate, b, step, step / 2 + step + prompt_tokens * prefill_per_token, step, True)


def replay_interleaved(arrivals: Sequence[float], prompt_tokens: Sequence[int], output_tokens: Sequence[int],
                       step_seconds: Callable[[float], float], prefill_per_token: float, token_budget: int = 64,
                       max_running: int = 8, block_size: int = 16) -> list[float]:
    """Each request's TTFT (s) on the interleaved design, predicted by replaying a known trace on paper: the engine's
    own scheduler (scheduler.plan_step: decodes first, prompts oldest first in the rest of the token budget, at
    most max_running admitted) decides every step, and a step lasts step_seconds(its decodes) + prefill_per_token x
    its prompt tokens (a step with no decode: the prompt tokens alone). A request's first token comes at the end of
    the step that runs its prompt's last chunk.

    Little's law (predict_load) sees the mean batch; this sees what a mean hides near capacity: prompts that arrive
    together queue for the budget (one waits for the chunks of the prompts ahead of it) and newcomers wait for a
    slot while max_running are running. KV blocks are taken as plentiful (the designs never preempt)."""
    from .scheduler import plan_step

    n = len(arrivals)
    if not (len(prompt_tokens) == len(output_tokens) == n) or n == 0:
        raise ValueError(f"replay_interleaved: needs as many prompt and output lengths as arrivals (>= 1), got "
                         f"{n}, {len(prompt_tokens)}, {len(output_tokens)}")
    if any(b < a for a, b in zip(arrivals, arrivals[1:])) or min(prompt_tokens) < 1 or min(output_tokens) < 1:
        raise ValueError("replay_interleaved: arrivals must be in order, prompts and outputs at least 1 token")
    seqs = [[p, 0, 0] for p in prompt_tokens]          # per request: [tokens so far, tokens computed, generated]
    first = [float("nan")] * n
    running: list[int] = []
    waiting: list[int] = []
    t, nxt, done = 0.0, 0, 0
    while done < n:
        while nxt < n and arrivals[nxt] <= t:           # arrivals join between steps, as the engine's loop admits
            waiting.append(nxt)
            nxt += 1
        if not running and not waiting:
            t = float(arrivals[nxt])                    # idle until the next arrival
            continue
        plan = plan_step([_state(seqs[i], block_size) for i in running], [_state(seqs[i], block_size) for i in waiting],
                         1 << 30, token_budget, block_size, max_running)
        work = [(running[j], k) for j, k in plan.run] + [(waiting[w], k) for w, k in plan.admit]
        admitted = [waiting[w] for w, _ in plan.admit]
        waiting = [i for i in waiting if i not in admitted]
        running += admitted
        decodes = sum(1 for i, _ in work if seqs[i][2] > 0)          # a request that has sampled runs one token
        prompt = sum(k for i, k in work if seqs[i][2] == 0)         # the rest are prompt chunks
        t += (step_seconds(decodes) if decodes else 0.0) + prefill_per_token * prompt
        for i, k in work:
            s = seqs[i]
            s[1] += k
            if s[1] == s[0]:                            # the step reached the last token: it samples the next one
                s[0] += 1
                s[2] += 1
                if s[2] == 1:
                    first[i] = t - float(arrivals[i])
                if s[2] == output_tokens[i]:
                    running.remove(i)
                    done += 1
    return first


def _state(seq: list[int], block_size: int):
    """replay_interleaved's [tokens, computed, generated] as the scheduler's SeqState."""
    from .scheduler import SeqState, blocks_for
    return SeqState(seq[0], seq[1], blocks_for(seq[1], block_size))
