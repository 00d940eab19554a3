"""Reasoning controls of every protocol: thinking budgets, ``reasoning_effort``, and grammars that
constrain the answer, not the thinking.

Request side (a builder's ``prepare``): ``budget_field`` reads a budget sent in vLLM's spelling
(``thinking_token_budget``) or SGLang's (``thinking_budget``); ``effort_controls`` maps an effort
(OpenAI's ``reasoning_effort``, Responses' ``reasoning.effort``) to a documented behaviour:

- ``none`` / ``minimal``: thinking off through the chat template (``enable_thinking: false``) where
  the template has that switch, else a budget of 0 (the engine ends the thinking at once);
- ``low`` / ``medium`` / ``high``: budgets of ``EFFORT_BUDGETS`` tokens, capped by ``max_tokens``.

A template that reads ``reasoning_effort`` itself (gpt-oss's) is given the effort as well. An
explicit budget wins over an effort's.

Engine side (the handler, ``apply_thinking``, once the reasoning parser of the engine is known):
a budget on a model whose reasoning parser is ``none`` is a 400 naming the field (an effort's
budget is dropped there: effort is a hint); on a thinking turned off by the template there is
no thinking to bound, and the budget is dropped. Otherwise ``SamplingParams.thinking`` gets the
parser's ``ThinkingFormat`` and the engine ends the thinking at the budget (``astrai.thinking``).

Grammars on a thinking model (``answer_grammar``): a structured-output or tool-call grammar is
wrapped into an xgrammar structural tag, a ``sequence`` of the thinking block (a ``tag`` of
``any_text`` between ``<think>`` and ``</think>``: its ``begin`` empty when the prompt opened
it, else ``optional``, as the model may not think), a little whitespace, then the original
constraint as the answer. The thinking runs free,
the answer is constrained, and the budget's forced ``\\n</think>\\n\\n`` is text the tag accepts.
A grammar that already describes the thinking (a regex or grammar whose text starts with
``<think>``, a structural tag in xgrammar's legacy form) is taken as given: it constrains the
whole output, so it cannot be combined with a budget (400).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from astrai.errors import RequestRejected
from astrai.grammar import GrammarSpec
from astrai.protocol import Prepared
from astrai.thinking import ThinkingFormat

__all__ = ["EFFORT_BUDGETS", "EFFORTS", "answer_grammar", "apply_thinking", "budget_field"]
__all__ += ["effort_controls"]

EFFORTS = ("none", "minimal", "low", "medium", "high")
EFFORT_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384}
"""Thinking budgets (tokens) of ``reasoning_effort``, each capped by the request's ``max_tokens``."""
_SPELLINGS = ("thinking_token_budget", "thinking_budget")
_WHITESPACE = {"type": "regex", "pattern": "[ \\t\\r\\n]{0,4}"}  # between </think> and the answer


def budget_field(request: Any) -> tuple[int | None, str | None]:
    """``(budget, field)`` of a request model with both spellings as fields (None, None: not sent).
    RequestRejected for both sent with different values, or a budget that is not an integer >= 0."""
    sent = [(name, getattr(request, name, None)) for name in _SPELLINGS]
    sent = [(name, value) for name, value in sent if value is not None]
    if len(sent) == 2 and sent[0][1] != sent[1][1]:
        raise RequestRejected(
            f"thinking_token_budget ({sent[0][1]}) and thinking_budget ({sent[1][1]}) differ: "
            "they are two spellings of one budget, send one",
            param="thinking_budget",
        )
    if not sent:
        return None, None
    name, value = sent[0]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestRejected(f"{name} must be an integer >= 0, got {value!r}", param=name)
    return value, name


def check_budget(budget: int | None, field: str | None, max_tokens: int) -> None:
    """RequestRejected naming ``field`` for a budget larger than ``max_tokens``."""
    if budget is not None and budget > max_tokens:
        raise RequestRejected(
            f"{field} ({budget}) must not exceed max_tokens ({max_tokens})", param=field or "thinking_budget"
        )


def effort_controls(
    effort: str | None, template: str, template_kwargs: dict[str, Any] | None, max_tokens: int
) -> tuple[dict[str, Any] | None, int | None]:
    """``(template kwargs, budget)`` for a reasoning ``effort`` (see the module doc): the client's
    kwargs win over the effort's (``enable_thinking`` they set stays)."""
    if effort is None:
        return template_kwargs, None
    kwargs, budget = {}, None
    if "reasoning_effort" in template:
        kwargs["reasoning_effort"] = effort
    if effort in ("none", "minimal"):
        if "enable_thinking" in template:
            kwargs["enable_thinking"] = False
        else:
            budget = 0
    else:
        budget = min(EFFORT_BUDGETS[effort], max_tokens)
    return {**kwargs, **(template_kwargs or {})} or None, budget


def apply_thinking(p: Prepared, reasoning: type | None, tokenizer: Any, opening: str = "") -> None:
    """Bind ``p.params``' budget and grammar to the engine's reasoning parser class ``reasoning``
    (None or ``none``: the model does not think). ``opening``: a forced tool call's start appended to
    the prompt (then the output is that call, with no thinking). Modifies ``p.params``."""
    params, field = p.params, p.thinking_param or "thinking_budget"
    fmt = None
    if reasoning is not None and getattr(reasoning, "end_of_thinking", None) and not opening:
        prompt = (p.prompts or [p.prompt_ids])[0]  # several prompts: the first one's tail decides
        fmt = reasoning(_tail(tokenizer, prompt)).thinking_format()
    budget = params.thinking_budget
    if budget is not None and fmt is None:
        if (reasoning is None or not reasoning.end_of_thinking) and field != "reasoning_effort":
            raise RequestRejected(
                f"{field}: this model does not think (its reasoning parser is "
                f"{getattr(reasoning, 'name', 'none')!r}); serve it with --reasoning-parser to budget it",
                param=field,
            )
        budget = None  # an effort on a model that does not think, or thinking turned off
    grammar = params.grammar
    if grammar is not None and fmt is not None:
        wrapped = answer_grammar(grammar, fmt)
        if wrapped is None and budget is not None:
            raise RequestRejected(
                f"{field} cannot be combined with a grammar that constrains the thinking itself "
                f"(it starts with {fmt.open}): the forced end of thinking would break it",
                param=field,
            )
        grammar = wrapped or grammar
    p.params = dataclasses.replace(
        params, thinking_budget=budget, thinking=fmt if budget is not None else None, grammar=grammar
    )


def answer_grammar(spec: GrammarSpec, fmt: ThinkingFormat) -> GrammarSpec | None:
    """``spec`` applied to the answer after a free thinking (see the module doc); None when ``spec``
    describes the thinking itself and is taken as given."""
    kind, value = spec.kind, spec.value
    if (kind == "regex" and value.lstrip("^").startswith(fmt.open)) or (
        kind == "grammar" and fmt.open in value
    ):
        return None
    if kind in ("json_schema", "json_object"):
        schema = json.loads(value) if kind == "json_schema" else {"type": "object"}
        answer: dict[str, Any] = {"type": "json_schema", "json_schema": schema}
        answer["max_whitespace_cnt"] = 0 if spec.compact else 16
    elif kind == "regex":
        answer = {"type": "regex", "pattern": value}
    elif kind == "choice":
        answer = {"type": "or", "elements": [{"type": "const_string", "value": c} for c in json.loads(value)]}
    elif kind == "grammar":
        answer = {"type": "grammar", "grammar": value, "syntax": "ebnf" if "::=" in value else "lark"}
    else:
        tag = json.loads(value)
        if "format" not in tag:  # xgrammar's legacy structures/triggers: a whole-output constraint
            return None
        answer = tag["format"]
    think: dict[str, Any] = {
        "type": "tag",
        "begin": "" if fmt.inside else fmt.open,
        "content": {"type": "any_text"},
        "end": fmt.close,
    }
    if not fmt.inside:  # the model may answer without thinking, as it would unconstrained
        think = {"type": "optional", "content": think}
    sequence = {"type": "sequence", "elements": [think, _WHITESPACE, answer]}
    return GrammarSpec.of("structural_tag", {"type": "structural_tag", "format": sequence})


def _tail(tokenizer: Any, ids: list[int]) -> str:
    """The last tokens of a prompt, decoded with their special tokens (``<think>`` may be one)."""
    try:
        return str(tokenizer.decode(ids[-16:], skip_special_tokens=False))
    except Exception:  # a duck-typed tokenizer without decode: no hint
        return ""
