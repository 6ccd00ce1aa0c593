"""Rendering chat conversations through the tokenizer's chat template."""
from __future__ import annotations

import functools
import json
import os
from typing import Any

Conversation = list[dict[str, Any]]


def load_chat_template(template: str | None) -> str | None:
    """A template given as a file path is read; otherwise the string is the template itself."""
    if template is None:
        return None
    if len(template) < 4096 and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    if "{" not in template and ("/" in template or template.endswith((".jinja", ".j2"))):
        raise ValueError(f"chat_template {template!r} looks like a path but no such file exists.")
    return template


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """'openai' when the template loops over a message's content (it expects a list of typed parts, as vLLM's
    auto-detection decides), else 'string'. A template that does not parse is left to fail at render time."""
    import jinja2
    from jinja2 import nodes
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return "string"

    def is_content(node: Any) -> bool:
        if isinstance(node, nodes.Getattr):
            return node.attr == "content"
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        return False
    # Also follow one assignment: {% set content = message['content'] %}{% for part in content %}
    aliases = {a.target.name for a in ast.find_all(nodes.Assign)
               if isinstance(a.target, nodes.Name) and is_content(a.node)}
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter):  # {% for part in message.content | selectattr(...) %}
            it = it.node
        if is_content(it) or (isinstance(it, nodes.Name) and it.name in aliases):
            return "openai"
    return "string"


def _flatten_content(content: Any, content_format: str, where: str = "content") -> Any:
    """OpenAI-style content parts -> what the template expects ('string': joined text; 'openai': parts, a plain
    string becoming one text part, as in vLLM)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content_format == "openai" else content
    if not isinstance(content, list):
        # Caught here: the template would fail on it with a Jinja error that names neither the message nor the field.
        raise ValueError(f"{where} must be a string or a list of content parts; got {type(content).__name__}.")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "refusal"):
            key = "refusal" if part["type"] == "refusal" else "text"  # a refusal: an earlier assistant turn
            if not isinstance(part.get(key), str):
                raise ValueError(f"{where}[{j}] of type {part['type']!r} needs a string {key!r}.")
            texts.append(part[key])
        elif isinstance(part, dict):
            if "type" not in part:
                raise ValueError(f"{where}[{j}] needs a 'type' (such as \"text\"); got {part!r:.80}.")
            raise ValueError(f"{where}[{j}]: content part of type {part.get('type')!r} is not supported (text only).")
        else:
            raise ValueError(f"{where}[{j}] must be a content part object; got {type(part).__name__}.")
    if content_format == "openai":
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(texts)


def message_text(message: dict[str, Any]) -> str:
    """A message's text as a string-format template receives it (its text parts joined by newlines); "" for no
    content or content the renderer would refuse."""
    content = message.get("content")
    if content is None:
        return ""
    try:
        return _flatten_content(content, "string")
    except ValueError:
        return ""


def _parse_arguments(tool_call: Any) -> Any:
    """OpenAI sends a call's arguments as JSON text; chat templates (Qwen, Llama, Hermes) expect the object."""
    if not isinstance(tool_call, dict):
        return tool_call
    fn = tool_call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            return tool_call
        tool_call = {**tool_call, "function": {**fn, "arguments": args}}
    return tool_call


def render_chat(tokenizer: Any, conversation: Conversation, *, chat_template: str | None = None,
                content_format: str = "auto", add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """Returns the prompt text. Raises ValueError for malformed conversations or a missing template."""
    if tokenizer is None:
        raise ValueError("Chat needs a tokenizer (skip_tokenizer_init is set).")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict of template variables, got "
                         f"{type(chat_template_kwargs).__name__}.")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("conversation", "tokenize"):
        if reserved in kwargs:
            raise ValueError(f"chat_template_kwargs may not set {reserved!r}.")
    # As in vLLM, chat_template_kwargs may set these three too; its values win over the arguments.
    add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
    continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
    tools = kwargs.pop("tools", tools)
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true.")
    if content_format not in ("auto", "string", "openai"):
        raise ValueError(f"Invalid chat template content format {content_format!r}; allowed: auto, string, openai.")
    template = load_chat_template(chat_template)
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("The tokenizer has no chat template; pass chat_template (a file or a Jinja string).")
    if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) or callable(t) for t in tools)):
        raise ValueError("tools must be a list of tool definitions (dicts such as {'type': 'function', 'function': "
                         f"{{'name': ..., 'parameters': {{...}}}}}}), got {tools!r:.80}.")
    if content_format == "auto":
        source = template if template is not None else tokenizer.chat_template
        content_format = detect_content_format(source) if isinstance(source, str) else "string"
    fmt = content_format
    msgs = []
    for i, m in enumerate(conversation):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}]: each chat message needs a 'role'; got {m!r:.80}.")
        if not isinstance(m["role"], str):  # the template would fail on it with a Jinja error naming nothing
            raise ValueError(f"messages[{i}].role must be a string; got {m['role']!r:.80}.")
        m = dict(m)
        if m.get("content") is None:
            # An assistant turn that only made tool calls has content null (or none at all); templates want text.
            m["content"] = [] if fmt == "openai" else ""
        else:
            m["content"] = _flatten_content(m["content"], fmt, f"messages[{i}].content")
        if m.get("tool_calls"):
            m["tool_calls"] = [_parse_arguments(tc) for tc in m["tool_calls"]]
        msgs.append(m)
    try:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tools=tools,
                                             chat_template=template, **kwargs)
    except ValueError:
        raise
    except Exception as e:  # jinja errors (raise_exception in templates, undefined values)
        raise ValueError(f"The chat template failed to render: {e}") from e
