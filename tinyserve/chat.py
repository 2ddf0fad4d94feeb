"""Lesson 5 in the terminal: `python -m tinyserve chat`, a multi-turn chat whose history lives in the prefix trie.

Every turn's prompt is the whole conversation so far plus the new message. With prefix caching the K/V of that
history are still in the trie from the previous turn, so only the new message is prefilled: TTFT stays flat as
the conversation grows instead of growing with it. Each turn prints how many prompt tokens were served from the
cache and its TTFT.

The conversation is kept as *token ids*, not text: the next prompt is the previous prompt + the tokens the model
generated + the new turn's tokens. Re-encoding the decoded reply could split it into different tokens than the
model produced (tokenization is not unique), and every token after the first difference would miss the cache.

A long chat outgrows the context window (or the KV pool): then the oldest turns are dropped, the system prompt
kept, and the chat says so. A message that could not fit even alone is refused, and the conversation goes on.
Ctrl-C during a reply stops that reply (its request is aborted, the turn is left out of the history) and returns to
the prompt; Ctrl-C at the prompt ends the chat.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Iterable, TextIO

from .backend import runs_on_kernels
from .kv_sizing import max_kv_blocks
from .sampling import SamplingParams
from .tokenizer import DEFAULT_SYSTEM_PROMPT, default_system_prompt, prompt_ids


@dataclass(frozen=True, slots=True)
class TurnStats:
    prompt_tokens: int
    cached_tokens: int      # of the prompt tokens, how many came from the prefix cache (not prefilled)
    output_tokens: int
    ttft: float             # seconds from submitting the turn to its first token
    seconds: float          # the whole turn


class Conversation:
    """The token ids of a conversation, grown turn by turn in the model's chat template (Tokenizer.render_turn,
    assistant_header and close_turn cut each step out of the template's renderings)."""

    def __init__(self, tokenizer, system: str = DEFAULT_SYSTEM_PROMPT):
        self.tok = tokenizer
        self.ids: list[int] = prompt_ids(tokenizer, tokenizer.render_turn("system", system))
        self.system_len = len(self.ids)
        self.turn_lens: list[int] = []     # tokens of each committed turn (user + reply), oldest first

    def prompt_for(self, user_text: str) -> list[int]:
        """The ids the model sees for this turn: history + user message + the assistant header."""
        turn = self.tok.render_turn("user", user_text) + self.tok.assistant_header()
        return self.ids + self.tok.encode_after(self.ids, turn)

    def commit(self, prompt: list[int], reply: list[int]) -> None:
        """Append the turn: the prompt it ran with, the reply as generated, closed as the template closes a turn
        (ChatML: <|im_end|>\\n, the marker only if the model did not emit it)."""
        new_ids = prompt + reply + self.tok.close_turn(reply)
        self.turn_lens.append(len(new_ids) - len(self.ids))
        self.ids = new_ids

    def drop_oldest_turns(self, n: int) -> None:
        """Forget the n oldest turns; the system prompt stays."""
        cut = sum(self.turn_lens[:n])
        self.ids = self.ids[:self.system_len] + self.ids[self.system_len + cut:]
        del self.turn_lens[:n]


def turns_to_drop(engine, conv: Conversation, user_text: str, params: SamplingParams) -> int | None:
    """How many of the oldest turns must go for this turn to fit: its prompt plus max_new_tokens within the context
    window, and its KV within the engine's pool. None if it would not fit even with every turn dropped."""
    window, bs = engine.config.max_seq_len, engine.block_size
    base = len(conv.prompt_for(user_text)) - sum(conv.turn_lens)    # system prompt + this message

    def fits(n_prompt: int) -> bool:
        return (n_prompt + params.max_new_tokens <= window    # the whole reply fits the window, not just its start
                and max_kv_blocks(n_prompt, params.max_new_tokens, window, bs) <= engine.blocks.num_blocks)

    for n in range(len(conv.turn_lens) + 1):
        if fits(base + sum(conv.turn_lens[n:])):
            return n
    return None


def chat_turn(engine, conv: Conversation, user_text: str, params: SamplingParams,
              out: TextIO | None = None) -> TurnStats:
    """Run one turn through the engine, streaming the reply to `out` (default: stdout)."""
    out = sys.stdout if out is None else out
    prompt = conv.prompt_for(user_text)
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params)
    stream = conv.tok.stream_decoder()
    ttft = None
    reply: list[int] = []
    try:
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id != rid:
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                reply += o.new_tokens
                for t in o.new_tokens:
                    out.write(stream.push(t))
                out.flush()
                if o.finish_reason == "error":
                    raise RuntimeError(f"the reply failed: {o.error}")
    except BaseException:   # Ctrl-C (or a failed reply): end the request, its blocks go back, the history stays
        engine.abort(rid)
        engine.pop_finished(rid)
        out.write("\n")
        out.flush()
        raise
    out.write(stream.flush() + "\n")
    out.flush()
    conv.commit(prompt, reply)
    cached = engine.blocks.hits.get(rid, (0, 0))[0]
    engine.pop_finished(rid)   # a chat runs for a long time: keep nothing per finished turn
    return TurnStats(len(prompt), cached, len(reply), ttft or 0.0, time.perf_counter() - t0)


def chat_loop(engine, tokenizer, lines: Iterable[str], params: SamplingParams, out: TextIO | None = None,
              err: TextIO | None = None, system: str = DEFAULT_SYSTEM_PROMPT,
              prompt_marker: str = "", before_turn=None) -> list[TurnStats]:
    """Read user lines until EOF or /quit; answer each, streamed to `out`; report per turn on `err`
    (default: stdout and stderr, looked up at call time). before_turn(): called before each turn (between two
    turns no request is in the engine: a safe point to switch its model)."""
    out, err = sys.stdout if out is None else out, sys.stderr if err is None else err
    conv = Conversation(tokenizer, system)
    turns: list[TurnStats] = []
    if prompt_marker:
        err.write(prompt_marker)
        err.flush()
    for line in lines:
        text = line.strip()
        if text in ("/quit", "/exit"):
            break
        if text:
            if before_turn is not None:
                before_turn()
            try:
                drop = turns_to_drop(engine, conv, text, params)
                if drop is None:
                    raise ValueError(f"this message does not fit the context ({engine.config.max_seq_len} tokens, "
                                     f"{engine.blocks.num_blocks * engine.block_size} in the KV pool) with "
                                     f"{params.max_new_tokens} tokens left for the reply; try a shorter one")
                if drop:
                    conv.drop_oldest_turns(drop)
                    err.write(f"[the conversation outgrew the context: dropped the {drop} oldest turn"
                              f"{'s' if drop > 1 else ''}, kept the system prompt]\n")
                s = chat_turn(engine, conv, text, params, out)
            except KeyboardInterrupt:     # Ctrl-C during the reply: stop it, back to the prompt
                err.write("[reply stopped; that turn is left out of the conversation]\n")
            except (ValueError, RuntimeError) as e:   # this message cannot be served (untokenizable, too long,
                err.write(f"[error: {e}]\n")         # a failed reply): the conversation so far is intact
            else:
                turns.append(s)
                pct = 100 * s.cached_tokens / s.prompt_tokens
                err.write(f"[turn {len(turns)}: {s.prompt_tokens} prompt tokens, {s.cached_tokens} from cache "
                          f"({pct:.0f}%), TTFT {s.ttft * 1e3:.0f} ms, {s.output_tokens} tokens in {s.seconds:.1f} s]\n")
        if prompt_marker:
            err.write(prompt_marker)
            err.flush()
    return turns


def main(args) -> int:
    """`python -m tinyserve chat` (see __main__.py for the options)."""
    from .engine import Engine
    from .cli_options import describe_backend, engine_kwargs, load_for_cli
    from . import jit

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                            seed=args.seed)
    tok, model = load_for_cli(args)     # the tokenizer first: a file without one fails before the weights load
    print(f"[{describe_backend(model)}]", file=sys.stderr)
    kernels = None
    log = lambda line: print(line, file=sys.stderr, flush=True)   # noqa: E731
    if runs_on_kernels(model):   # lesson 7: never compile inside a timed turn
        model, kernels = jit.prepare(model, "engine", background=not args.speculative, log=log)
    engine = Engine(model, tokenizer=tok, prefix_caching=not args.no_prefix_cache, **engine_kwargs(args, model))

    def before_turn() -> None:   # cold start: once the background compile is done, the next turn runs fast
        if kernels is not None and kernels.ready():
            kernels.switch(engine, 0)
            log(f"[the kernels compiled in the background in {kernels.seconds:.1f} s: from this turn on, "
                f"{describe_backend(engine.model)}]")
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"tinyserve chat: prefix caching {'off' if args.no_prefix_cache else 'on'}, "
              f"{args.num_blocks} KV blocks of {args.block_size}. Type a message; /quit or Ctrl-D ends.",
              file=sys.stderr)
    try:
        chat_loop(engine, tok, sys.stdin, params, system=args.system or default_system_prompt(tok),
                  prompt_marker="> " if interactive else "", before_turn=before_turn)
    except BaseException:
        if kernels is not None and kernels.bg is not None:
            kernels.bg.stop()
        raise
    if kernels is not None:
        kernels.leave_compiling(log, "start")
    return 0
