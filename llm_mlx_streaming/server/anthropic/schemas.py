"""Request bodies of the Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`).

Every field Anthropic documents that this engine can honour is declared; any other is a
400 naming it. The engine options are extension fields (from knobs.py, as on the OpenAI
routes), less those this API has under its own name: `stop` (`stop_sequences`),
`thinking` and `thinking_budget` (`thinking: {"type": ..., "budget_tokens": ...}`),
`tool_choice` (`tool_choice: {"type": ...}`) and
`parallel_tool_calls` (`tool_choice.disable_parallel_tool_use`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, model_validator

from ..openai.schemas import StrictModel, engine_fields


class CacheControl(StrictModel):
    """Accepted: the engine reuses its KV cache for every prefix anyway."""

    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: Optional[CacheControl] = None


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = Field(None, description="Accepted as given back; it is not checked")


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock]] = ""
    is_error: Optional[bool] = None
    cache_control: Optional[CacheControl] = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[Union[TextBlock, ThinkingBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class ThinkingEnabled(StrictModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1, description="Most tokens of reasoning: the think block is closed after "
                               "this many (the plugin's thinking_budget)")


class ThinkingAdaptive(StrictModel):
    type: Literal["adaptive"]


class ThinkingDisabled(StrictModel):
    type: Literal["disabled"]


Thinking = Annotated[Union[ThinkingEnabled, ThinkingAdaptive, ThinkingDisabled], Field(discriminator="type")]


class Tool(StrictModel):
    type: Optional[Literal["custom"]] = None
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: dict[str, Any]
    cache_control: Optional[CacheControl] = None
    strict: Optional[bool] = Field(None, description="A call forced by tool_choice any or tool always follows "
                                   "input_schema (constrained decoding); with auto the model is not constrained")


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"] = Field(
        description="any and tool are enforced by constrained decoding; none shows the model no tools")
    name: Optional[str] = Field(None, description="The tool to call, with type tool")
    disable_parallel_tool_use: Optional[bool] = Field(None, description="true: at most one call per reply")

    def option(self) -> str:
        """The plugin's tool_choice option."""
        return {"any": "required", "tool": self.name}.get(self.type, self.type)

    @model_validator(mode="after")
    def _named_when_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is given with type tool, and only then")
        return self


class Metadata(StrictModel):
    user_id: Optional[str] = Field(None, description="Accepted; it changes nothing")


class JsonOutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema the reply must follow")

    model_config = {**StrictModel.model_config, "populate_by_name": True}


class OutputConfig(StrictModel):
    format: Optional[JsonOutputFormat] = Field(None, description="The reply is constrained to this schema")


class _Conversation(StrictModel):
    """What both routes read: the model, the system prompt, the messages, the tools."""

    model: Optional[str] = Field(None, description="A model id from /v1/models (default: the server's)")
    system: Union[str, list[TextBlock], None] = None
    messages: list[Message] = Field(min_length=1)
    thinking: Optional[Thinking] = Field(None, description="enabled or adaptive: the template's thinking "
                                         "switch on, and its reasoning as thinking blocks; disabled: off")
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    output_config: Optional[OutputConfig] = None
    cache_control: Optional[CacheControl] = None

    def system_text(self) -> Optional[str]:
        if isinstance(self.system, list):
            return "".join(block.text for block in self.system)
        return self.system

    def schema_dict(self) -> Optional[dict]:
        fmt = self.output_config.format if self.output_config else None
        return fmt.schema_ if fmt else None

    def thinking_options(self) -> dict:
        """The plugin's thinking options: the switch, and the budget of `enabled`."""
        if self.thinking is None:
            return {}
        if isinstance(self.thinking, ThinkingEnabled):
            return {"thinking": True, "thinking_budget": self.thinking.budget_tokens}
        return {"thinking": self.thinking.type != "disabled"}


AnthropicEngineOptions = engine_fields("AnthropicEngineOptions", exclude=(
    "stop", "thinking", "thinking_budget", "tool_choice", "parallel_tool_calls"))


class MessagesRequest(_Conversation, AnthropicEngineOptions):
    max_tokens: int = Field(ge=1, description="Most tokens generated (also capped by the context)")
    stop_sequences: Optional[list[str]] = Field(None, description="End the reply before any of these")
    stream: bool = False
    metadata: Optional[Metadata] = None


class CountTokensRequest(_Conversation):
    """The conversation alone (output_config and cache_control change no prompt token)."""


class ErrorBody(StrictModel):
    type: str
    message: str


class AnthropicError(StrictModel):
    type: Literal["error"] = "error"
    error: ErrorBody
