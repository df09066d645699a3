"""OpenAI's tool fields: the function specs, `tool_choice`, and the calls in messages
and replies, as pydantic models, turned into what the plugin takes (function specs, the
`tool_choice` option, the core's calls)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator

from ...prompt.tools import function_spec
from ...reply.events import ToolCall
from ..conversation import call_arguments
from ..fields import RequestModel


class FunctionSpec(RequestModel):

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}},
                                       description="A JSON schema of the arguments")
    strict: Optional[bool] = Field(None, description="A call forced by tool_choice required or a name "
                                   "always follows the schema (constrained decoding); with auto the "
                                   "model is not constrained")


class ToolSpec(RequestModel):

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(RequestModel):

    name: str

    @field_validator("name")
    @classmethod
    def _not_a_mode(cls, value: str) -> str:
        if value in ("auto", "none", "required"):  # the option would read it as the mode
            raise ValueError(f"a tool named {value!r} cannot be chosen by name")
        return value


class OpenAINamedToolChoice(RequestModel):

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["auto", "none", "required"], OpenAINamedToolChoice]


class OpenAICalledFunction(RequestModel):

    name: str
    arguments: str = Field(description="The arguments, a JSON object as text")

    @field_validator("arguments")
    @classmethod
    def _a_json_object(cls, value: str) -> str:
        call_arguments(value)
        return value


class OpenAIToolCall(RequestModel):

    id: str
    type: Literal["function"] = "function"
    function: OpenAICalledFunction

    def call(self) -> ToolCall:
        """The call as the server's conversation holds it."""
        return ToolCall(self.id, self.function.name, call_arguments(self.function.arguments))


def function_specs(specs: Optional[list[ToolSpec]]) -> list[dict]:
    """The request's tools as the chat template's function specs (the server never runs them)."""
    return [function_spec(s.function.name, s.function.description, s.function.parameters) for s in specs or []]


def choice_option(choice: Optional[ToolChoice]) -> Optional[str]:
    """`tool_choice` as the plugin's option: auto, none, required or the tool's name."""
    return choice.function.name if isinstance(choice, OpenAINamedToolChoice) else choice


def reply_calls(calls) -> list[dict]:
    """A reply's calls (reply.events.ToolCall) in OpenAI's layout."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_text}}
            for c in calls]
