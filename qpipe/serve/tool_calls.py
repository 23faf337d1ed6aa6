"""Forced tool calls: a chat request whose `tool_choice` names a function, or is "required", gets
its call as a structured output, so the arguments always parse and fit the function's schema
(vLLM serves these two choices the same way). "auto" is not served: telling a call from text
needs a parser for each model family's own tool-call syntax.

A named choice constrains the output to the function's parameters; "required" to a JSON array of
one or more {"name", "parameters"} objects, each for one of the tools. The text is then read
back as OpenAI's `tool_calls`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from qpipe.serve.openai_protocol import ChatTool, FunctionCall, NamedToolChoice, ToolCall
from qpipe.serve.sampling_params import StructuredOutput

# a function declared without parameters takes none, as OpenAI reads it: its arguments are {}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ForcedToolCall:
    """The tools a request offers and the one it names (None: "required", any of them)."""

    tools: tuple[ChatTool, ...]
    name: str | None

    @classmethod
    def of(
        cls, tools: list[ChatTool] | None, choice: str | NamedToolChoice | None
    ) -> ForcedToolCall | None:
        """The forced call a request asks for, or None for none ("none", or no tools). Raises
        ValueError for "auto" and for a name the tools do not declare."""
        if choice == "none" or (not tools and choice is None):
            return None
        if not tools:
            raise ValueError("tool_choice needs tools to choose from")
        if choice is None or choice == "auto":
            raise ValueError(
                "tool_choice 'auto' (the default with tools) is not supported: it needs a parser "
                "for the model's own tool-call syntax; send tool_choice 'required' or a named "
                "function (the call is then enforced as a structured output), or 'none'"
            )
        if choice == "required":
            return cls(tuple(tools), None)
        assert isinstance(choice, NamedToolChoice)
        names = [tool.function.name for tool in tools]
        if choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}; the tools are {names}")
        return cls(tuple(tools), choice.function.name)

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "stop" for a call the request named, "tool_calls" for one the model chose."""
        return "stop" if self.name is not None else "tool_calls"

    def structured_output(self) -> StructuredOutput:
        if self.name is not None:
            (tool,) = [t for t in self.tools if t.function.name == self.name]
            return StructuredOutput("json_schema", json.dumps(_parameters(tool)))
        call_schemas = [
            {
                "type": "object",
                "properties": {
                    "name": {"enum": [tool.function.name]},
                    "parameters": _parameters(tool),
                },
                "required": ["name", "parameters"],
            }
            for tool in self.tools
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": call_schemas}}
        return StructuredOutput("json_schema", json.dumps(schema))

    def calls(self, text: str) -> list[ToolCall] | None:
        """The output read as tool calls; None when it is not complete JSON (cut by max_tokens
        or a stop string), in which case it is returned as text."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.name is not None:
            return [ToolCall(function=FunctionCall(name=self.name, arguments=text))]
        return [
            ToolCall(
                function=FunctionCall(name=call["name"], arguments=json.dumps(call["parameters"]))
            )
            for call in value
        ]


def _parameters(tool: ChatTool) -> dict:
    return tool.function.parameters or NO_PARAMETERS
