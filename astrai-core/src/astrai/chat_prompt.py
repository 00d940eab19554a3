"""Chat messages to prompt token ids through the model's chat template, tools included.

Protocol-neutral (``astrai.protocol`` re-exports ``chat_prompt_ids`` for builders).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["chat_prompt_ids"]

_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    prefill: str = "",
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` (Hugging Face chat convention) through the model's chat template,
    then those of ``prefill`` (the start of the assistant's answer, which generation continues).

    Everything that comes from the request (content, tool calls and results, tools, the
    prefill) is text: a special-token string typed in it (``<|im_end|>``) is encoded as plain
    text, never as the control token (``Tokenizer.apply_chat_template``, ``encode_plain``),
    so a message cannot close its turn and open another. The template's own markers are the
    prompt's only control tokens.

    ``tools`` (``[{"type": "function", "function": {...}}]``) go to the template.
    A template that never mentions ``tools`` (SmolLM2's, for one) would drop
    them, so they are described in the system message instead, in the
    Hermes/Qwen ``<tool_call>`` format; likewise an assistant turn's
    ``tool_calls`` become ``<tool_call>`` text for a template that ignores them.
    ``template_kwargs`` (OpenAI's ``chat_template_kwargs``: ``{"enable_thinking": false}``) are more
    variables for the template; only passed when given (a duck-typed tokenizer may not take them).
    Raises ``RequestRejected`` (from the tokenizer) when the template fails.
    """
    template = getattr(tokenizer, "chat_template", None) or ""
    if tools and "tools" not in template:
        described = _TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{described}"}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": described}, *messages]
        tools = None
    if "tool_calls" not in template:
        messages = [_inline_tool_calls(m) if m.get("tool_calls") else m for m in messages]
    extra = {"template_kwargs": template_kwargs} if template_kwargs else {}
    ids = list(
        tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, **extra)
    )
    if prefill:
        encode_plain = getattr(tokenizer, "encode_plain", None)  # a duck-typed tokenizer may lack it
        ids += encode_plain(prefill) if encode_plain else tokenizer.encode(prefill, add_special_tokens=False)
    return ids


def _inline_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    calls = "\n".join(
        "<tool_call>\n"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        + "\n</tool_call>"
        for c in message["tool_calls"]
    )
    content = f"{message.get('content') or ''}\n{calls}".lstrip("\n")
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}
