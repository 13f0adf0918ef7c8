"""Chat templates: the checkpoint's own Jinja template, rendered as transformers does.

A chat model expects its conversation laid out in its own format (ChatML for
SmolLM2: `<|im_start|>user\\n...<|im_end|>\\n`), and the checkpoint ships that
format as a Jinja template (`tokenizer_config.json`, `chat_template.jinja`, or a
GGUF's `tokenizer.chat_template`). We render it with `jinja2` in a sandbox with
the same settings and helpers as transformers (`trim_blocks`, `lstrip_blocks`,
`loopcontrols`, `raise_exception`, `tojson`, `strftime_now`, the special tokens
as variables), so the prompt string is the one the model was trained on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """A conversation the template refuses, or a template that does not render."""


def _raise(message):
    raise ChatTemplateError(f"messages: the chat template says: {message}")


@lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: \
        json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template: does not compile ({e})") from None


def check_messages(messages) -> list[dict]:
    """A conversation as a list of {role, content} dicts with text content; content given
    as OpenAI-style text parts is joined. Errors name the message and field."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages: expected a list of {role, content} objects")
    if not messages:
        raise ChatTemplateError("messages: must not be empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"messages[{i}]: expected an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ChatTemplateError(f"messages[{i}].role: must be one of {', '.join(ROLES)}, "
                                    f"got {role!r}")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise ChatTemplateError(f"messages[{i}].content[{j}]: only text parts "
                                            "are supported")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content: expected text")
        out.append({"role": role, "content": content})
    return out


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None] | None = None):
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        _compile(source)  # fail at load time, not at the first request

    def render(self, messages, add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return _compile(self.source).render(
                messages=check_messages(messages), add_generation_prompt=add_generation_prompt,
                tools=None, documents=None, **self.special_tokens)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: cannot render ({e})") from None
