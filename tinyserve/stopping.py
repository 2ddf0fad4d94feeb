"""When does a request end? EOS, the token budget, the context window, or a stop string."""
from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig
from .sampling import SamplingParams


@dataclass(slots=True)
class StopChecker:
    config: ModelConfig
    params: SamplingParams
    tokenizer: object | None = None   # needed only for stop strings
    max_new_tokens: int | None = None
    prompt_len: int = 0
    reason: str | None = None         # "eos" | "length" | "context" | "stop" once stopped

    def __post_init__(self) -> None:
        if self.max_new_tokens is None:
            self.max_new_tokens = self.params.max_new_tokens
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the output")

    def should_stop(self, out: list[int]) -> bool:
        """Call after appending each new token; sets `reason` when the request is done."""
        if not self.params.ignore_eos and out and out[-1] in self.config.eos_token_ids:
            self.reason = "eos"
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
