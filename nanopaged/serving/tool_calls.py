"""Tool calls for the chat completions endpoint, as vLLM makes them.

The request's `tools` reach the chat template, which describes them to the model. Then,
by `tool_choice`: "none" leaves the text alone; a named function constrains the output
to that function's arguments (a JSON object following its parameter schema); "required"
constrains it to a JSON array of one or more calls `{"name", "parameters"}` of the tools
(one, without `parallel_tool_calls`); "auto" (the default when tools are given) leaves
the model free and parses the Hermes-style `<tool_call>{"name": ..., "arguments":
...}</tool_call>` blocks that Qwen's templates teach. Calls are returned in OpenAI's
`tool_calls`, and streamed as OpenAI streams them: a call's id, type and name first,
then its arguments.
"""

import json
import re
import uuid

from nanopaged.sampling_params import StructuredOutputsParams

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPENING = "<tool_call>"


def choice(body: dict) -> tuple[str, str | None]:
    """The request's tool choice: ("none" | "auto" | "required" | "named", the named
    function)."""
    tools, tool_choice = body.get("tools"), body.get("tool_choice")
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError(
            f"tool_choice must be 'none', 'auto', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}"
        )
    if name not in tool_names(tools):
        raise ValueError(
            f"tool_choice names the function {name!r}, which is not in tools"
        )
    return "named", name


def tool_names(tools) -> list[str]:
    return [tool["function"]["name"] for tool in tools or ()]


def constraint(
    body: dict, kind: str, name: str | None
) -> StructuredOutputsParams | None:
    """The structured output that a "required" or named tool choice asks for."""
    functions = {
        tool["function"]["name"]: tool["function"].get("parameters")
        or {"type": "object"}
        for tool in body.get("tools") or ()
    }
    if kind == "named":
        return StructuredOutputsParams(json=functions[name])
    if kind != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": function}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for function, parameters in functions.items()
    ]
    one = body.get("parallel_tool_calls") is False
    return StructuredOutputsParams(
        json={
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": calls},
            **({"maxItems": 1} if one else {}),
        }
    )


def call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse(text: str, kind: str, name: str | None) -> tuple[str | None, list[dict]]:
    """A whole completion's content (None when it only calls tools) and its tool calls.
    The calls "required" asks for that max_tokens or a stop string cut short are no
    JSON: the text is then content, beside the completion's finish_reason ("length" or
    "stop")."""
    if kind == "named":
        return None, [call(name, text)]
    if kind == "required":
        try:
            return None, [
                call(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)
            ]
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []
    if kind == "auto":
        calls = [_hermes_call(block) for block in HERMES.findall(text)]
        calls = [c for c in calls if c is not None]
        if calls:
            content = text[: text.index(OPENING)].strip()
            return content or None, calls
    return text, []


def _hermes_call(block: str) -> dict | None:
    try:
        parsed = json.loads(block)
        return call(parsed["name"], json.dumps(parsed.get("arguments", {})))
    except (json.JSONDecodeError, KeyError, TypeError):
        return None  # not a call after all: it stays in the text


class ToolCallStream:
    """Turns the growing text of one streamed completion into OpenAI's chat deltas:
    content, and tool calls as each becomes known."""

    def __init__(self, kind: str, name: str | None):
        self.kind, self.name = kind, name
        self.shown = 0  # characters of the text already sent or consumed
        self.calls: list[dict] = []

    def deltas(self, text: str, finished: bool) -> list[dict]:
        if self.kind == "named":
            return self._named(text)
        if self.kind == "required":
            if not finished:
                return []  # the array's calls are known once it is whole
            content, calls = parse(text, "required", None)
            return (
                self._content(text, len(text))
                if content is not None
                else self._calls(calls)
            )
        if self.kind != "auto":
            return self._content(text, len(text))
        return self._auto(text, finished)

    def _named(self, text: str) -> list[dict]:
        arguments, self.shown = text[self.shown :], len(text)
        if not self.calls:
            self.calls.append(call(self.name, arguments))
            return [{"tool_calls": [dict(self.calls[0], index=0)]}]
        return (
            [{"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]}]
            if arguments
            else []
        )

    def _auto(self, text: str, finished: bool) -> list[dict]:
        deltas = []
        while True:
            opening = text.find(OPENING, self.shown)
            if opening < 0:
                # hold back what may be the start of an opening tag
                end = len(text) if finished else _safe_end(text, self.shown)
                return deltas + self._content(text, end)
            deltas += self._content(text, opening)
            closing = text.find("</tool_call>", opening)
            if closing < 0:
                return deltas + (self._content(text, len(text)) if finished else [])
            found = _hermes_call(text[opening + len(OPENING) : closing])
            end = closing + len("</tool_call>")
            deltas += self._calls([found]) if found else self._content(text, end)
            self.shown = end

    def _content(self, text: str, end: int) -> list[dict]:
        content, self.shown = text[self.shown : end], max(self.shown, end)
        return [{"content": content}] if content else []

    def _calls(self, calls: list[dict]) -> list[dict]:
        first = len(self.calls)
        self.calls += calls
        return [{"tool_calls": [dict(c, index=first + i)]} for i, c in enumerate(calls)]


def _safe_end(text: str, start: int) -> int:
    """Where the text may be shown up to: before any suffix that could begin an opening
    tag."""
    for length in range(min(len(OPENING) - 1, len(text) - start), 0, -1):
        if OPENING.startswith(text[len(text) - length :]):
            return len(text) - length
    return len(text)
