"""Chat templates rendered as Hugging Face's apply_chat_template renders them (tinyserve/chat_template.py).

The expected renderings come from transformers itself (tests/fixtures/chat_templates.json, written by
tools/make_chat_template_fixture.py in the reference venv) for real templates: Llama 3.2, Qwen2.5, Qwen3, Mistral Nemo,
SmolLM3, Phi-3.5; plain, multi-turn, with tools, with a tool call and its result. A conversation transformers could
not render must fail here too, with the same message.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tinyserve.chat_template import ChatTemplate, ChatTemplateError

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "chat_templates.json").read_text())
TEMPLATES = FIXTURE["templates"]
CASES = [(name, case) for name, t in TEMPLATES.items() for case in t["cases"]]


def template(name: str) -> ChatTemplate:
    t = TEMPLATES[name]
    return ChatTemplate(t["template"], t["special_tokens"])


@pytest.mark.parametrize("name, case", CASES, ids=[f"{n}-{c['name']}" for n, c in CASES])
def test_renders_as_transformers(name, case):
    t = template(name)
    args = (case["messages"], case["add_generation_prompt"], case.get("tools"))
    if "error" in case:
        with pytest.raises(ChatTemplateError, match="refused") as e:
            t.render(*args, **FIXTURE["kwargs"])
        assert case["error"] in str(e.value)
    else:
        assert t.render(*args, **FIXTURE["kwargs"]) == case["rendered"]


def test_the_fixture_covers_what_it_claims():
    assert len(TEMPLATES) >= 5
    assert sum("error" not in c for _, c in CASES) >= 25
    assert any("tool_calls" in m for _, c in CASES for m in c["messages"] if "error" not in c)


@pytest.mark.parametrize("name", TEMPLATES)
def test_reads_tools_says_whether_tools_change_the_prompt(name):
    t = template(name)
    msgs = [{"role": "user", "content": "Hi"}]
    tools = next(c["tools"] for c in TEMPLATES[name]["cases"] if c.get("tools"))
    changed = t.render(msgs, True, tools, **FIXTURE["kwargs"]) != t.render(msgs, True, None, **FIXTURE["kwargs"])
    assert t.reads_tools == changed
    # Phi-3.5 has no tool support; this SmolLM3 template renders tool results but never lists the tools
    assert t.reads_tools == (name not in ("microsoft-Phi-3.5-mini-instruct", "HuggingFaceTB-SmolLM3-3B"))


def test_raise_exception_reaches_the_caller():
    t = template("mistralai-Mistral-Nemo-Instruct-2407")   # roles must alternate user/assistant
    with pytest.raises(ChatTemplateError, match="conversation roles must alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",                       # reaching Python's internals
    "{{ messages.append({'role': 'x'}) }}",             # mutating the caller's list (immutable sandbox)
    "{% set ns = namespace(_x=1) %}{{ ns._x }}",       # a dunder-ish namespace attribute
    "{{ raise_exception('no thanks') }}",
])
def test_the_sandbox_refuses(source):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render(messages)
    assert messages == [{"role": "user", "content": "Hi"}]


def test_helpers_as_transformers_gives_them():
    src = ("{{ messages[0] | tojson }}|{{ {'a': '<&>'} | tojson(indent=1) }}|{{ strftime_now('%Y') | length }}|"
           "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% endfor %}|"
           "{% generation %}kept{% endgeneration %}|{{ bos_token }}{{ eos_token }}")
    out = ChatTemplate(src, {"bos_token": "<s>", "eos_token": None}).render(
        [{"role": "user", "content": "é"}, {"role": "user", "content": "two"}])
    assert out == '{"role": "user", "content": "é"}|{\n "a": "<&>"\n}|4|two|kept|<s>'


def test_a_syntax_error_is_one_line():
    with pytest.raises(ChatTemplateError, match=r"does not parse \(line 1"):
        ChatTemplate("{% for m in messages %}")


# --- through the Tokenizer --------------------------------------------------------------------------------------

# TinyLlama-1.1B-Chat's template (Zephyr's format), for the turn boundaries of a SentencePiece vocabulary
TINYLLAMA = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
             "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}"
             "\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
             "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")


def tokenizer_with(vocab: str, template_name: str | None):
    """A GGUF vocabulary's tokenizer wearing one of the fixture's templates (None: no template, the fallback)."""
    import copy
    from tests.llama_cpp_files import vocab_tokenizer
    tok = copy.copy(vocab_tokenizer(vocab))      # the shared one keeps the file's own template
    if template_name == "tinyllama":
        tok.chat_template = ChatTemplate(TINYLLAMA, {"bos_token": "<s>", "eos_token": "</s>"})
    else:
        tok.chat_template = template(template_name) if template_name else None
    return tok


def test_tokenizer_passes_tools_and_tool_messages():
    tok = tokenizer_with("qwen2", "Qwen-Qwen2.5-7B-Instruct")
    case = next(c for c in TEMPLATES["Qwen-Qwen2.5-7B-Instruct"]["cases"] if c["name"] == "tool-turn")
    assert tok.template_supports_tools
    text = tok.apply_chat_template(case["messages"], tools=case["tools"])
    assert text == case["rendered"]
    assert tok.encode_chat(case["messages"], tools=case["tools"]) == tok.encode(text)
    # system, user, assistant (its call), the result (Qwen shows it as a user turn), the generation prompt
    assert tok.encode(text).count(tok._tok.token_to_id("<|im_start|>")) == 5


def test_tools_without_a_template_that_reads_them_is_an_error():
    tok = tokenizer_with("phi-3", "microsoft-Phi-3.5-mini-instruct")
    assert not tok.template_supports_tools
    with pytest.raises(ValueError, match="does not read `tools`"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[{"type": "function"}])


def test_the_gguf_template_is_used():
    from tests.llama_cpp_files import vocab_gguf
    from tinyserve.tokenizer import load_tokenizer
    tok = load_tokenizer(vocab_gguf("phi-3"))      # its GGUF carries Phi-3's template
    assert tok.chat_template is not None
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == "<s><|user|>\nHi<|end|>\n<|assistant|>\n"
    tok = load_tokenizer(vocab_gguf("gpt-2"))      # none: ChatML, the fallback
    assert tok.chat_template is None
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]).startswith("<|im_start|>system\n")


@pytest.mark.parametrize("vocab, name", [("llama-bpe", "meta-llama-Llama-3.2-3B-Instruct"),
                                         ("qwen2", "Qwen-Qwen2.5-7B-Instruct"), ("qwen2", "Qwen-Qwen3-0.6B"),
                                         ("qwen2", None), ("llama-spm", "tinyllama"),
                                         ("phi-3", "microsoft-Phi-3.5-mini-instruct")])
def test_chat_grows_the_prompt_as_the_template_renders_the_conversation(vocab, name):
    # `python -m tinyserve chat` keeps the conversation as ids and appends each turn; every prompt must be the ids of
    # the whole conversation rendered at once (else every turn would miss the prefix cache, or the model would see
    # a prompt it was not tuned on). Qwen3 renders the last assistant turn with an empty <think> block only while it
    # is the last: the prompt of the next turn is what must match. TinyLlama's Zephyr template on Llama 2's
    # SentencePiece vocabulary (turns meet in plain text after </s>: '</s>\\n<|user|>') and Phi-3's (its markers
    # swallow the newline after them) test encode_after's boundaries.
    from tinyserve.chat import Conversation
    tok = tokenizer_with(vocab, name)
    conv = Conversation(tok, system="Be brief.")
    msgs = [{"role": "system", "content": "Be brief."}]
    for question, answer in [("Hi", "Hello there."), ("And 2+2?", "4."), ("Bye", "")]:
        msgs.append({"role": "user", "content": question})
        prompt = conv.prompt_for(question)
        assert prompt == tok.encode_chat(msgs)
        reply = tok.encode_after(prompt, answer) + tok.close_turn([])[:1]   # as the model writes it, end marker
        conv.commit(prompt, reply)                                         # included
        msgs.append({"role": "assistant", "content": answer})


def test_a_template_that_does_not_render_turn_by_turn_says_so():
    from tinyserve.chat import Conversation
    tok = tokenizer_with("llama-spm", "mistralai-Mistral-Nemo-Instruct-2407")   # the system prompt moves
    with pytest.raises(ValueError, match="turn by turn"):
        Conversation(tok, system="Be brief.").prompt_for("Hi")


@pytest.mark.real
@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
])
def test_smollm2s_template_renders_the_chatml_fallback(smol_tok, messages):
    from tinyserve.tokenizer import DEFAULT_SYSTEM_PROMPT, default_system_prompt
    assert smol_tok.chat_template is not None                  # the folder's tokenizer_config.json has one
    assert default_system_prompt(smol_tok) == DEFAULT_SYSTEM_PROMPT
    fallback = smol_tok.chat_template
    try:
        smol_tok.chat_template = None
        chatml = [smol_tok.apply_chat_template(messages, g) for g in (True, False)]
    finally:
        smol_tok.chat_template = fallback
    assert [smol_tok.apply_chat_template(messages, g) for g in (True, False)] == chatml


def test_the_default_system_prompt_names_smollm_only_for_smollm():
    from tinyserve.tokenizer import DEFAULT_SYSTEM_PROMPT, GENERIC_SYSTEM_PROMPT, default_system_prompt
    assert default_system_prompt(tokenizer_with("qwen2", None)) == DEFAULT_SYSTEM_PROMPT            # ChatML fallback
    assert default_system_prompt(tokenizer_with("llama-bpe", "meta-llama-Llama-3.2-3B-Instruct")) == \
        GENERIC_SYSTEM_PROMPT
