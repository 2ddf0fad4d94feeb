"""The chat loop on the tiny model: a message too long for the context is refused and the chat goes on;
when the history outgrows the window the oldest turns go (the system prompt stays) and the chat says so; Ctrl-C
during a reply stops it, frees its blocks and returns to the prompt."""
from __future__ import annotations

import io

import pytest

import tinyserve as ts
from tinyserve.chat import Conversation, chat_loop
from tinyserve.engine import Engine
from tinyserve.sampling import SamplingParams


class LetterChatTokenizer:
    """A ChatML-ish tokenizer over letters for the tiny model (vocab 256): each character is one token."""
    eos_id = 2

    def encode(self, text):
        return [3 + ord(c) % 250 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i % 26) for i in ids)

    @staticmethod
    def render_turn(role, content):
        return f"<{role[0]}>{content}\n"

    @staticmethod
    def assistant_header():
        return "<a>"

    def close_turn(self, reply):
        return ([] if reply and reply[-1] == self.eos_id else [self.eos_id]) + self.encode("\n")

    def encode_after(self, history, text):
        return self.encode(text)

    def stream_decoder(self):
        tok = self

        class Stream:
            def push(self, t):
                return tok.decode([t])

            def flush(self):
                return ""
        return Stream()


PARAMS = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)


def chat(engine, lines, system="be brief"):
    out, err = io.StringIO(), io.StringIO()
    turns = chat_loop(engine, LetterChatTokenizer(), lines, PARAMS, out=out, err=err, system=system)
    return turns, out.getvalue(), err.getvalue()


def idle_and_clean(engine):
    alloc = engine.blocks.allocator
    alloc.check()
    return not engine.has_unfinished() and alloc.num_used == engine.blocks.cache.num_cached


def test_a_message_too_long_for_the_context_is_refused_and_the_chat_goes_on():
    model = ts.tiny_model(seed=0, max_seq_len=64)
    engine = Engine(model, num_blocks=64, block_size=4, prefix_caching=True)
    turns, out, err = chat(engine, ["hi\n", "x" * 80 + "\n", "and now?\n"])
    assert len(turns) == 2                          # used to end the chat ("start a new chat")
    assert "[error: this message does not fit the context (64 tokens" in err and "[turn 2:" in err
    assert idle_and_clean(engine)


def test_the_oldest_turns_are_dropped_when_the_history_outgrows_the_window():
    model = ts.tiny_model(seed=0, max_seq_len=64)
    engine = Engine(model, num_blocks=64, block_size=4, prefix_caching=True)
    lines = [f"question {i}\n" for i in range(6)]   # each turn: ~14 + 6 + 2 tokens; the window holds two or three
    turns, out, err = chat(engine, lines, system="sys")
    assert len(turns) == 6
    assert "[the conversation outgrew the context: dropped the" in err and "kept the system prompt]" in err
    assert all(t.prompt_tokens + PARAMS.max_new_tokens <= 64 for t in turns)
    assert idle_and_clean(engine)


def test_dropping_turns_keeps_the_system_prompt_and_the_latest_turns():
    tok = LetterChatTokenizer()
    conv = Conversation(tok, "sys")
    system = list(conv.ids)
    first = conv.prompt_for("one")
    conv.commit(first, [7, 8])
    second = conv.prompt_for("two")
    conv.commit(second, [9])
    latest = conv.ids[len(second) - len(tok.encode(tok.render_turn("user", "two") + tok.assistant_header())):]
    conv.drop_oldest_turns(1)
    assert conv.ids == system + latest and conv.turn_lens == [len(latest)]


def test_the_pool_is_a_limit_too():
    model = ts.tiny_model(seed=0, max_seq_len=1024)
    engine = Engine(model, num_blocks=8, block_size=4, prefix_caching=True)     # 32 positions
    turns, out, err = chat(engine, ["hello\n", "again\n", "y" * 40 + "\n", "bye\n"], system="s")
    assert len(turns) == 3 and "32 in the KV pool" in err and "dropped the" in err
    assert idle_and_clean(engine)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_ctrl_c_during_a_reply_stops_it_and_returns_to_the_prompt(monkeypatch, prefix_caching):
    model = ts.tiny_model(seed=0)
    engine = Engine(model, num_blocks=64, block_size=4, prefix_caching=prefix_caching)
    real_step, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 2:                          # in the middle of the first reply
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    turns, out, err = chat(engine, ["first\n", "second\n"])
    assert "[reply stopped; that turn is left out of the conversation]" in err
    assert len(turns) == 1 and "[turn 1:" in err                 # the second message was answered as usual
    assert engine.finished == {}                                  # the aborted request was forgotten too
    assert idle_and_clean(engine)
