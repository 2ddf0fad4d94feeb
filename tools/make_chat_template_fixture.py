"""Write tests/fixtures/chat_templates.json: real models' chat templates rendered by Hugging Face transformers.

    .venv-ref/bin/python tools/make_chat_template_fixture.py /path/to/llama_cpp_python-0.3.36.tar.gz

The templates are the ones llama.cpp tests its own chat code with (vendor/llama.cpp/models/templates in the
llama-cpp-python 0.3.36 sdist): Llama 3.2, Qwen2.5, Qwen3, Mistral Nemo, SmolLM3, Phi-3.5. Each is rendered by
transformers' own `PreTrainedTokenizerFast.apply_chat_template` (tokenize=False) for a few conversations: plain,
system + user + assistant (+ user), with tools, with a tool call and its result. A conversation a template refuses
(its raise_exception) is recorded as the error message. tests/test_chat_template.py renders the same with
tinyserve.chat_template and compares; CI needs no transformers.

Standard library + transformers only (runs in the reference venv, which has no tinyserve dependencies).
"""
from __future__ import annotations

import argparse
import json
import tarfile
from pathlib import Path

TEMPLATES = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/"
# the special tokens each model's tokenizer_config.json names (the template sees them as variables)
MODELS = {
    "meta-llama-Llama-3.2-3B-Instruct": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "Qwen-Qwen2.5-7B-Instruct": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "Qwen-Qwen3-0.6B": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "mistralai-Mistral-Nemo-Instruct-2407": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "HuggingFaceTB-SmolLM3-3B": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
    "microsoft-Phi-3.5-mini-instruct": {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>"},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name"}},
                   "required": ["city"]}}}
CALL = {"id": "call12345", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What's the weather in Paris?"}
CASES = [
    {"name": "plain", "messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True},
    {"name": "system-user-assistant", "add_generation_prompt": False,
     "messages": [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
    {"name": "second-turn", "add_generation_prompt": True,
     "messages": [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                  {"role": "user", "content": "Name a colour — in français, \"quoted\" & <tagged>."}]},
    {"name": "tools", "messages": [USER], "tools": [WEATHER], "add_generation_prompt": True},
    *({"name": f"tool-turn{suffix}", "tools": [WEATHER], "add_generation_prompt": True,
       "messages": [USER, {"role": "assistant", "content": content, "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "call12345", "name": "get_weather",
                     "content": "{\"temperature_c\": 18}"}]}
      # OpenAI clients send content "" or None beside tool calls; transformers drops a None key
      for suffix, content in (("", ""), ("-content-none", None))),
]
KWARGS = {"date_string": "26 Jul 2024"}   # Llama 3.x prints today's date otherwise


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sdist", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests" / "fixtures"
                    / "chat_templates.json")
    args = ap.parse_args()

    import transformers
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    with tarfile.open(args.sdist) as tar:
        sources = {name: tar.extractfile(TEMPLATES + name + ".jinja").read().decode() for name in MODELS}
    out = {"generated_by": f"tools/make_chat_template_fixture.py, transformers {transformers.__version__}",
           "templates_from": "llama-cpp-python 0.3.36 sdist, " + TEMPLATES.split("/", 1)[1] + " (llama.cpp, MIT)",
           "kwargs": KWARGS, "templates": {}}
    for name, specials in MODELS.items():
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                      **specials)
        cases = []
        for case in CASES:
            got = dict(case)
            try:
                got["rendered"] = tok.apply_chat_template(case["messages"], tools=case.get("tools"),
                                                          add_generation_prompt=case["add_generation_prompt"],
                                                          chat_template=sources[name], tokenize=False, **KWARGS)
            except Exception as e:   # the template's raise_exception: recorded, tinyserve must refuse it too
                got["error"] = str(e)
            cases.append(got)
        out["templates"][name] = {"template": sources[name], "special_tokens": tok.special_tokens_map,
                                  "cases": cases}
        print(name, [("error: " + c["error"][:50]) if "error" in c else len(c["rendered"]) for c in cases])
    args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
