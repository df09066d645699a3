"""Request bodies of the Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`).

Every field Anthropic documents that this engine can honour is declared, and those it
cannot use but changes no reply are declared hints (fields.py: accepted and named back).
The engine options are extension fields (from knobs.py, as on the OpenAI routes), less
those this API has under its own name: `stop` (`stop_sequences`), `thinking` and
`thinking_budget` (`thinking: {"type": ..., "budget_tokens": ...}`), `tool_choice`
(`tool_choice: {"type": ...}`) and `parallel_tool_calls`
(`tool_choice.disable_parallel_tool_use`): given under the plugin's name they are a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, model_validator

from ..fields import RequestModel, hint, options_model, options_set
from ..keep_alive import KeepAlive


CACHED = "the engine reuses its KV cache for every prefix anyway"


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: Optional[dict[str, Any]] = hint(CACHED)


class Base64Source(RequestModel):
    type: Literal["base64"]
    media_type: str = Field(description="image/png, image/jpeg, image/webp or image/gif")
    data: str


class UrlSource(RequestModel):
    type: Literal["url"]
    url: str = Field(description="Fetched by the server when its image_urls setting is on")


class FileSource(RequestModel):
    """Declared so that it is refused in one line: no file is kept here."""

    type: Literal["file"]
    file_id: str


class ImageBlock(RequestModel):
    """An image in a user message, for a model that takes images (server/images.py)."""

    type: Literal["image"]
    source: Annotated[Union[Base64Source, UrlSource, FileSource], Field(discriminator="type")]
    cache_control: Optional[dict[str, Any]] = hint(CACHED)

    def url(self) -> str:
        """The image as a URL: a data URL for base64 data."""
        if isinstance(self.source, Base64Source):
            return f"data:{self.source.media_type};base64,{self.source.data}"
        if isinstance(self.source, UrlSource):
            return self.source.url
        raise ValueError("a file source: no file is kept on this server (send the image as base64 or a url)")


class ThinkingBlock(RequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = Field(None, description="Accepted as given back; it is not checked")


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Optional[dict[str, Any]] = hint(CACHED)


ResultPart = Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[ResultPart]] = ""
    is_error: Optional[bool] = None
    cache_control: Optional[dict[str, Any]] = hint(CACHED)

    def images(self) -> bool:
        return not isinstance(self.content, str) and any(b.type == "image" for b in self.content)

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[Union[TextBlock, ImageBlock, ThinkingBlock, ToolUseBlock, ToolResultBlock],
                  Field(discriminator="type")]


class Message(RequestModel):
    role: Literal["user", "assistant", "system"] = Field(description="system: a system message inside the "
                                                         "conversation (Claude Code sends its environment so)")
    content: Union[str, list[Block]]

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class ThinkingEnabled(RequestModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1, description="Most tokens of reasoning: the think block is closed after "
                               "this many (the plugin's thinking_budget)")
    display: Optional[str] = hint("the reasoning is returned as thinking blocks as generated")


class ThinkingAdaptive(RequestModel):
    type: Literal["adaptive"]
    display: Optional[str] = hint("the reasoning is returned as thinking blocks as generated")


class ThinkingDisabled(RequestModel):
    type: Literal["disabled"]


Thinking = Annotated[Union[ThinkingEnabled, ThinkingAdaptive, ThinkingDisabled], Field(discriminator="type")]


class Tool(RequestModel):
    type: Optional[Literal["custom"]] = None
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: dict[str, Any]
    cache_control: Optional[dict[str, Any]] = hint(CACHED)
    strict: Optional[bool] = Field(None, description="A call forced by tool_choice any or tool always follows "
                                   "input_schema (constrained decoding); with auto the model is not constrained")


class ToolChoice(RequestModel):
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


class JsonOutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema the reply must follow")

    model_config = {**RequestModel.model_config, "populate_by_name": True}


class OutputConfig(RequestModel):
    format: Optional[JsonOutputFormat] = Field(None, description="The reply is constrained to this schema")
    effort: Optional[str] = hint("the chat template has no effort level (thinking is its switch)")


BILLING = "x-anthropic-billing-header:"


class _Conversation(RequestModel):
    """What both routes read: the model, the system prompt, the messages, the tools."""

    model: Optional[str] = Field(None, description="A model id from /v1/models (default: the server's)")
    system: Union[str, list[TextBlock], None] = None
    messages: list[Message] = Field(min_length=1)
    thinking: Optional[Thinking] = Field(None, description="enabled or adaptive: the template's thinking "
                                         "switch on, and its reasoning as thinking blocks; disabled: off")
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    output_config: Optional[OutputConfig] = None
    cache_control: Optional[dict[str, Any]] = hint(CACHED)
    context_management: Optional[dict[str, Any]] = hint("the conversation is prompted whole: no edit is applied")
    mcp_servers: Optional[list[Any]] = hint("no MCP server is called from here: the client runs its tools")
    container: Optional[Any] = hint("no code-execution container here")

    def system_text(self) -> Optional[str]:
        """The system prompt, less Claude Code's billing line (`billing_line`)."""
        if isinstance(self.system, list):
            return "".join(block.text for block in self.system if not block.text.startswith(BILLING))
        if self.system is not None and self.system.startswith(BILLING):
            return self.system.partition("\n")[2]
        return self.system

    def billing_line(self) -> bool:
        """Whether the system prompt starts with Claude Code's `x-anthropic-billing-header:`
        line: meant for Anthropic's billing, not the model, with a suffix that follows the
        session's first prompt and (toward Anthropic's own URL) a nonce that changes each
        request, in front of everything else, so kept in the prompt it would leave no
        prefix for the KV cache to reuse."""
        blocks = self.system if isinstance(self.system, list) else [self.system or ""]
        return any(getattr(block, "text", block).startswith(BILLING) for block in blocks)

    def schema_dict(self) -> Optional[dict]:
        fmt = self.output_config.format if self.output_config else None
        return fmt.schema_ if fmt else None

    def plugin_options(self) -> dict:
        """The plugin's options the request sets: its extension fields and what Anthropic's
        own fields (stop_sequences, thinking, tool_choice) mean in the plugin's terms."""
        fields = options_set(self, AnthropicEngineOptions.model_fields)
        fields.update(self._thinking_options())
        if self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice.option()
            if self.tool_choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        return fields

    def _thinking_options(self) -> dict:
        """The plugin's thinking options: the switch, and the budget of `enabled`."""
        if self.thinking is None:
            return {}
        if isinstance(self.thinking, ThinkingEnabled):
            return {"thinking": True, "thinking_budget": self.thinking.budget_tokens}
        return {"thinking": self.thinking.type != "disabled"}


AnthropicEngineOptions = options_model("AnthropicEngineOptions", exclude=(
    "stop", "thinking", "thinking_budget", "tool_choice", "parallel_tool_calls"))


# The plugin's options this API has under its own name: given as they are, a 400 that names Anthropic's.
RENAMED = {"stop": "stop_sequences", "thinking_budget": "thinking.budget_tokens",
           "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}


class MessagesRequest(_Conversation, AnthropicEngineOptions, KeepAlive):
    max_tokens: int = Field(ge=1, description="Most tokens generated (also capped by the context)")
    stop_sequences: Optional[list[str]] = Field(None, description="End the reply before any of these")
    stream: bool = False
    metadata: Optional[dict[str, Any]] = hint("the client's bookkeeping (user_id)")
    service_tier: Optional[str] = hint("one tier here")

    @model_validator(mode="after")
    def _renamed_options(self):
        for name in self.model_extra or {}:
            if name in RENAMED:
                raise ValueError(f"{name}: this API's field is {RENAMED[name]}")
        return self

    def plugin_options(self) -> dict:
        fields = super().plugin_options()
        if self.stop_sequences:
            fields["stop"] = self.stop_sequences
        return fields


class CountTokensRequest(_Conversation):
    """The conversation alone (output_config and cache_control change no prompt token)."""


class ErrorBody(RequestModel):
    type: str
    message: str


class AnthropicError(RequestModel):
    type: Literal["error"] = "error"
    error: ErrorBody
