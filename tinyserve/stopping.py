"""When does a request end? EOS, the token budget, the context window, a stop string, or a complete JSON value."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .config import ModelConfig, check_positive_int
from .constrained import ConstraintState, grammars_for
from .model import check_token_ids
from .sampling import SamplingParams


@dataclass(slots=True)
class StopChecker:
    config: ModelConfig
    params: SamplingParams
    tokenizer: object | None = None   # needed only for stop strings and json_schema
    max_new_tokens: int | None = None
    prompt_len: int = 0
    reason: str | None = None         # "eos" | "length" | "context" | "stop" once stopped (the engine may also
                                      # set "error" or "abort": this is the one place a finish reason lives)
    # structured output (params.json_schema): where the request is in its grammar. It ends the request once the
    # value is complete, and the sampler masks the logits with it (sampling.sample_tokens)
    constraint: ConstraintState | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.max_new_tokens is None:
            self.max_new_tokens = self.params.max_new_tokens
        self.max_new_tokens = check_positive_int("max_new_tokens", self.max_new_tokens)
        if self.params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the output")
        if self.params.json_schema is not None:
            if not hasattr(self.tokenizer, "token_bytes"):
                raise ValueError("json_schema needs the tokenizer (Engine(..., tokenizer=...)) to know what each "
                                 "token spells")
            grammars = grammars_for(self.tokenizer, self.config.vocab_size, self.config.eos_token_ids)
            self.constraint = grammars.get(self.params.json_schema).start()

    def should_stop(self, out: list[int]) -> bool:
        """Call after appending each new token; sets `reason` when the request is done."""
        if not self.params.ignore_eos and out and out[-1] in self.config.eos_token_ids:
            self.reason = "eos"
        elif self.constraint is not None and self.constraint.finished:
            self.reason = "stop"      # the JSON value is complete and nothing may follow it
        elif len(out) >= self.max_new_tokens:
            self.reason = "length"
        elif self.prompt_len + len(out) >= self.config.max_seq_len:
            self.reason = "context"   # the next token would have no position left
        elif self.params.stop:
            # only the tail can contain a new match: decode enough tokens to cover the longest stop string
            tail = self.tokenizer.decode(out[-(max(map(len, self.params.stop)) + 8):])
            if any(s in tail for s in self.params.stop):
                self.reason = "stop"
        return self.reason is not None


def start_request(config: ModelConfig, ids: Sequence[int], max_new_tokens: int | None = None,
                  params: SamplingParams | None = None,
                  tokenizer=None) -> tuple[np.ndarray, StopChecker, np.random.Generator]:
    """What every generate loop does first: validate the prompt, set up stopping and the request's own rng.

    Returns (tokens [T] int64, stopper, rng). `max_new_tokens` overrides params.max_new_tokens when given.
    """
    params = params or SamplingParams()
    if params.json_schema is not None:
        raise ValueError("json_schema is served by the Engine (generate --strategy paged), not by this loop")
    n_new = params.max_new_tokens if max_new_tokens is None else max_new_tokens
    tokens = check_token_ids(config, ids)
    stopper = StopChecker(config, params, tokenizer, max_new_tokens=n_new, prompt_len=len(tokens))
    return tokens, stopper, params.make_rng()
