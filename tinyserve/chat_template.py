"""A model's chat template (Jinja, from the GGUF's `tokenizer.chat_template` or tokenizer_config.json), rendered the
way Hugging Face's `apply_chat_template` renders it, so a prompt is byte for byte the one the model was tuned on.

A template is code from the model's publisher: it runs in jinja2's immutable sandbox (no attribute tricks, no
mutation of the caller's lists), with exactly the helpers transformers gives it: `raise_exception`, `strftime_now`,
a `tojson` that does not escape HTML, `dict`, a `namespace` without dunder attributes, `{% generation %}` blocks
and loop controls. It sees `messages`, `tools` (JSON schemas, None without tools), `add_generation_prompt`,
`documents` and the special tokens (`bos_token`, `eos_token`, ...).

    t = ChatTemplate(source, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    t.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    t.reads_tools            # whether the template looks at `tools` at all
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import numpy as np


class ChatTemplateError(ValueError):
    """The template refused the conversation (its raise_exception) or failed to render; the message says which."""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes <, >, & and ' for HTML, which a prompt must not see
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment():
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks what the assistant wrote (for training masks): rendering
        just keeps its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """namespace(...) whose attributes cannot start with '_' (no reaching into Python's internals)."""
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set the namespace attribute {name!r}")

    class Dict:
        """dict(...) and dict.fromkeys(...) without handing the template the type itself."""
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=Dict(), namespace=Namespace)
    return env


def _plain(value: Any) -> Any:
    """JSON-like data only (str, numbers, bool, None, dicts, lists): the template never gets an object with
    methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, np.generic):                 # np.bool_(False) would otherwise be a truthy placeholder
        return _plain(value.item())
    if isinstance(value, str):                        # subclasses (enums, ...) back to the base type; str() of a
        return str.__str__(value)                     # str-valued enum would give its name, not its value
    for base in (bool, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


class ChatTemplate:
    """One model's template, parsed once; `render` gives the prompt text of a conversation."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None):
        import jinja2
        from jinja2 import meta

        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        env = _environment()
        try:
            self._template = env.from_string(source)
            variables = meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not parse (line {e.lineno}: {e.message})") from None
        self.reads_tools = "tools" in variables

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
               tools: Sequence[Mapping] | None = None, **kwargs) -> str:
        """The prompt text of `messages` (keys whose value is None are dropped, as transformers does: many
        templates test `'content' in message` or print None)."""
        import jinja2

        chat = [{k: _plain(v) for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(messages=chat, tools=_plain(tools), documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **_plain(kwargs)})
        except jinja2.TemplateError as e:   # raise_exception(...) in the template, or a sandbox violation
            raise ChatTemplateError(f"the chat template refused the conversation: {e}") from None
