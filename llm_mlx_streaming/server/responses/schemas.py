"""Request bodies of OpenAI's Responses API, as Codex, the openai-agents SDK and the
`openai` client send them.

`input` is a string or items (messages with text parts, function calls and their
outputs, reasoning given back, custom tool calls); `tools` are functions (a `namespace`
holds more of them), custom tools (free text, or text a Lark or regex grammar allows),
and hosted tools this server cannot run (`web_search`, ...: dropped and named). Fields
that change nothing here are declared hints (fields.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from ..fields import RequestModel, hint, options_model, options_set
from ..keep_alive import KeepAlive

ITEM_ID = "an item's id: items are matched by call_id"
SOURCE_ID = "the call's id on the server that made it"


class TextPart(RequestModel):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal"]
    text: str = ""
    refusal: Optional[str] = None
    annotations: Optional[list[Any]] = hint("a reply's annotations given back")
    logprobs: Optional[list[Any]] = hint("a reply's logprobs given back")

    def value(self) -> str:
        return self.refusal if self.type == "refusal" and self.refusal else self.text


class InputImage(RequestModel):
    """An image in a user message, for a model that takes images (server/images.py)."""

    type: Literal["input_image"]
    image_url: Optional[str] = Field(None, description="A data URL, or an http(s) URL the server fetches when "
                                     "its image_urls setting is on")
    file_id: Optional[str] = Field(None, description="Refused: no file is kept on this server")
    detail: Optional[str] = hint("the image is given to the model at the size its processor takes")

    def url(self) -> str:
        if self.file_id is not None:
            raise ValueError("file_id: no file is kept on this server (send image_url, e.g. a data URL)")
        if self.image_url is None:
            raise ValueError("image_url: required (a data URL, or an http(s) URL)")
        return self.image_url


class FilePart(RequestModel):
    """Declared so that it is refused in one line: the models served here read text and images."""

    type: Literal["input_file", "input_audio"]


Part = Annotated[Union[TextPart, InputImage, FilePart], Field(discriminator="type")]
Content = Union[str, list[Part]]


class MessageItem(RequestModel):
    type: Optional[Literal["message"]] = None
    role: Literal["system", "developer", "user", "assistant"]
    content: Content
    id: Optional[str] = hint(ITEM_ID)
    status: Optional[str] = hint("an item's status given back")
    phase: Optional[str] = hint("an assistant message's phase given back")


class _Call(RequestModel):
    """A call an earlier reply made, given back."""

    call_id: str
    name: str
    namespace: Optional[str] = Field(None, description="The namespace tool the function is in")
    id: Optional[str] = hint(SOURCE_ID)
    status: Optional[str] = hint("an item's status given back")


class FunctionCallItem(_Call):
    type: Literal["function_call"]
    arguments: str = "{}"


class CustomToolCallItem(_Call):
    type: Literal["custom_tool_call"]
    input: str = ""


class _Output(RequestModel):
    """What the client's tool answered to a call."""

    call_id: str
    output: Content = ""
    id: Optional[str] = hint(ITEM_ID)
    status: Optional[str] = hint("an item's status given back")


class FunctionCallOutputItem(_Output):
    type: Literal["function_call_output"]


class CustomToolCallOutputItem(_Output):
    type: Literal["custom_tool_call_output"]


class ReasoningItem(RequestModel):
    type: Literal["reasoning"]
    summary: list[TextPart] = []
    content: Optional[list[TextPart]] = None
    encrypted_content: Optional[str] = hint("this server's reasoning is given back as text")
    id: Optional[str] = hint(ITEM_ID)
    status: Optional[str] = hint("an item's status given back")

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(p.value() for p in parts)


def _item_type(value) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind or "message"


Item = Annotated[Union[
    Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
    Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Annotated[CustomToolCallItem, Tag("custom_tool_call")],
    Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")],
    Annotated[ReasoningItem, Tag("reasoning")],
], Discriminator(_item_type)]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = Field(None, description="A call forced by tool_choice always follows the "
                                   "parameters (constrained decoding); with auto the model is not constrained")
    defer_loading: Optional[bool] = hint("every tool is shown to the model")


class GrammarFormat(RequestModel):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str


class TextFormat(RequestModel):
    type: Literal["text"]


class CustomTool(RequestModel):
    type: Literal["custom"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    description: Optional[str] = None
    format: Optional[Annotated[Union[GrammarFormat, TextFormat], Field(discriminator="type")]] = Field(
        None, description="grammar: a call forced by tool_choice follows it (constrained decoding)")
    defer_loading: Optional[bool] = hint("every tool is shown to the model")


class NamespaceTool(RequestModel):
    type: Literal["namespace"]
    name: str
    description: Optional[str] = None
    tools: list[Annotated[Union[FunctionTool, CustomTool], Field(discriminator="type")]] = []


class HostedTool(RequestModel):
    """A tool OpenAI runs on its side (web_search, file_search, ...): nothing here can.
    It is dropped whole and named by its type, its own fields unread."""

    model_config = ConfigDict(extra="ignore")

    type: str


def _tool_type(value) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "custom", "namespace") else "hosted"


Tool = Annotated[Union[
    Annotated[FunctionTool, Tag("function")], Annotated[CustomTool, Tag("custom")],
    Annotated[NamespaceTool, Tag("namespace")], Annotated[HostedTool, Tag("hosted")],
], Discriminator(_tool_type)]


class NamedToolChoice(RequestModel):
    type: Literal["function", "custom"]
    name: str


class AllowedTools(RequestModel):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"] = "auto"
    tools: list[dict[str, Any]] = []


ToolChoice = Union[Literal["auto", "none", "required"], NamedToolChoice, AllowedTools]


class JsonSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    name: Optional[str] = None
    schema_: dict[str, Any] = Field(alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = Field(None, description="Always strict: the reply is constrained to the schema")

    model_config = {**RequestModel.model_config, "populate_by_name": True}


class JsonObjectFormat(RequestModel):
    type: Literal["json_object"]


class TextConfig(RequestModel):
    format: Optional[Annotated[Union[TextFormat, JsonSchemaFormat, JsonObjectFormat],
                               Field(discriminator="type")]] = None
    verbosity: Optional[str] = hint("the model's own length")


class Reasoning(RequestModel):
    effort: Optional[str] = Field(None, description="none or minimal: the template's thinking switch off; "
                                  "low to high: on, or gpt-oss's reasoning effort (when the template has one)")
    summary: Optional[str] = hint("the reasoning comes whole, as the summary text of a reasoning item")
    generate_summary: Optional[str] = hint("the reasoning comes whole, as the summary text of a reasoning item")


# The plugin's options this API has under its own name (the thinking ones named back so: `SPELLED`).
RENAMED = {"max_tokens": "max_output_tokens", "thinking": "reasoning.effort", "reasoning_effort": "reasoning.effort"}
SPELLED = {"reasoning_effort": "reasoning.effort"}

ResponsesEngineOptions = options_model("ResponsesEngineOptions", exclude=(*RENAMED, "tool_choice",
                                                                          "parallel_tool_calls"))


class ResponseRequest(ResponsesEngineOptions, KeepAlive):
    model: Optional[str] = Field(None, description="A model id from /v1/models (default: the server's)")
    input: Union[str, list[Item]] = Field(description="The conversation: a user message, or items")
    instructions: Optional[str] = Field(None, description="A system message before the input")
    max_output_tokens: Optional[int] = Field(None, ge=1, description="Most tokens generated")
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = Field(None, description="false: at most one call per reply")
    text: Optional[TextConfig] = None
    reasoning: Optional[Reasoning] = None
    stream: bool = False
    store: Optional[bool] = Field(None, description="false: not kept for previous_response_id or GET "
                                  "(default true: kept in a bounded store, the oldest first out)")
    previous_response_id: Optional[str] = Field(None, description="Continue a stored response: its "
                                                "conversation and reply come before this input")
    include: Optional[list[str]] = hint("reasoning comes as summary text; nothing else is included")
    metadata: Optional[dict[str, Any]] = hint("the client's bookkeeping (kept with a stored response)")
    user: Optional[str] = hint("an end-user id")
    safety_identifier: Optional[str] = hint("an end-user id")
    prompt_cache_key: Optional[str] = hint("the KV cache is reused for any matching prefix")
    prompt_cache_retention: Optional[str] = hint("the KV cache is reused for any matching prefix")
    client_metadata: Optional[dict[str, Any]] = hint("the client's bookkeeping")
    service_tier: Optional[str] = hint("one tier here")
    truncation: Optional[Literal["auto", "disabled"]] = hint("a prompt longer than the context is refused")
    background: Optional[bool] = Field(None, description="Only false: a reply is streamed or waited for")

    @model_validator(mode="after")
    def _what_cannot_be_honoured(self):
        if self.background:
            raise ValueError("background: true is not supported by this server (accepted: false)")
        for name in self.model_extra or {}:
            if name in RENAMED:
                raise ValueError(f"{name}: this API's field is {RENAMED[name]}")
        return self

    def plugin_options(self) -> dict:
        """The plugin's options the request sets: its extension fields and what its own
        (max_output_tokens, tool_choice, parallel_tool_calls, reasoning.effort) mean in the
        plugin's terms. A reply that is a custom tool's input (`forced_custom`) has thinking
        off: it is the input from its first token."""
        fields = options_set(self, ResponsesEngineOptions.model_fields)
        if self.max_output_tokens is not None:
            fields["max_tokens"] = self.max_output_tokens
        if self.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        choice = self.tool_choice
        if self.forced_custom() is not None:
            fields["thinking"] = False
        elif isinstance(choice, NamedToolChoice):
            fields["tool_choice"] = choice.name
        elif isinstance(choice, str):
            fields["tool_choice"] = choice
        elif choice is not None:  # allowed_tools: every tool is shown; its mode is honoured
            fields["tool_choice"] = choice.mode
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort is not None and self.forced_custom() is None:
            fields["reasoning_effort"] = effort  # whether it applies: policy.RequestPolicy.unswitched
        return fields

    def forced_custom(self) -> Optional[str]:
        """The custom tool tool_choice names, whose input the whole reply is."""
        choice = self.tool_choice
        return choice.name if isinstance(choice, NamedToolChoice) and choice.type == "custom" else None
