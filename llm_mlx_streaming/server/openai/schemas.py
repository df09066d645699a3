"""Request and response bodies of the OpenAI-compatible routes, as pydantic models.

The request models subclass the plugin's own `Options`, so every engine option the
plugin has (expert_slots, policy, memory_budget, and each one added later) is a body
field with the plugin's validation and its description in the OpenAPI schema, with no
list to keep in step here. Nothing is dropped silently (fields.py): a field not declared
here is accepted and named back (a 400 naming it with --strict), and the OpenAI fields
this server does not implement are accepted only at their no-op value (docs/server.md
lists them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from ...options.settings import Options
from ..conversation import ChatMessage, ImagePart
from ..fields import RequestModel, engine_option_names, hint, options_set
from ..keep_alive import KeepAlive
from .tools import OpenAIToolCall, ToolChoice, ToolSpec, choice_option

class TextContent(BaseModel):
    type: Literal["text"]
    text: str


class ImageUrl(RequestModel):
    url: str = Field(description="A data URL (data:image/png;base64,...), or an http(s) URL the server fetches "
                     "when its image_urls setting is on")
    detail: Optional[str] = hint("the image is given to the model at the size its processor takes")


class ImageContent(RequestModel):

    type: Literal["image_url"]
    image_url: ImageUrl


Content = Annotated[Union[TextContent, ImageContent], Field(discriminator="type")]


# OpenAI fields accepted only at the value that changes nothing, {field: allowed values}.
NO_OP_FIELDS = {"presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {})}
# Fields of an assistant message as OpenAI returns it, accepted back only empty.
EMPTY_MESSAGE_FIELDS = ("refusal", "audio", "function_call", "annotations")


class OpenAIMessage(RequestModel):

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Content], None] = None
    reasoning_content: Optional[str] = Field(None, description="An assistant message's reasoning")
    tool_calls: Optional[list[OpenAIToolCall]] = Field(None, description="An assistant message's tool calls")
    tool_call_id: Optional[str] = Field(None, description="A tool message's call: the result is its answer")
    refusal: Optional[str] = Field(None, description="Only null")
    audio: Optional[dict[str, Any]] = Field(None, description="Only null")
    function_call: Optional[dict[str, Any]] = Field(None, description="Only null (tool_calls replace it)")
    annotations: Optional[list[Any]] = Field(None, description="Only null or []")
    name: Optional[str] = hint("a participant's name is not shown to the model")
    tokens: Optional[list[int]] = Field(
        None,
        description="Extension: the token ids an assistant message was generated as "
        "(a response's mlx_stream.tokens); with them the KV cache is reused exactly",
    )

    @model_validator(mode="after")
    def _fields_of_its_role(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message makes tool calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool_call_id: a tool message, and only a tool message, answers a call")
        for name in EMPTY_MESSAGE_FIELDS:
            if getattr(self, name):
                raise ValueError(f"{name}: not supported by this server (accepted: null)")
        images = isinstance(self.content, list) and any(isinstance(p, ImageContent) for p in self.content)
        if images and self.role != "user":
            raise ValueError(f"content: an image comes in a user message, not in a {self.role} message")
        return self

    def message(self) -> ChatMessage:
        """As the server's conversation message (a developer message is a system message)."""
        if isinstance(self.content, list):
            parts = [p.text if isinstance(p, TextContent) else ImagePart(p.image_url.url) for p in self.content]
        else:
            parts = [self.content or ""]
        return ChatMessage("system" if self.role == "developer" else self.role, parts, self.reasoning_content or "",
                           [call.call() for call in self.tool_calls or []], self.tool_call_id, self.tokens)


class StreamOptions(RequestModel):

    include_usage: bool = False


class OpenAIJsonSchema(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: Optional[str] = None
    description: Optional[str] = None
    strict: Optional[bool] = Field(None, description="Always strict: the reply is constrained to the schema")
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema the reply must follow")


class ResponseFormat(RequestModel):

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[OpenAIJsonSchema] = None

    def schema_dict(self) -> Optional[dict]:
        """The schema to constrain the reply to (None: free text)."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            return self.json_schema.schema_ if self.json_schema else {"type": "object"}
        return None


class _GenerationRequest(Options, KeepAlive):
    """What both generation routes take: the plugin's options plus OpenAI's fields."""

    model_config = ConfigDict(extra="allow")

    server: SkipJsonSchema[None] = None  # SERVER_ONLY: not part of the API

    model: Optional[str] = Field(None, description="A model id from /v1/models (default: the server's)")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="Same as max_tokens")
    n: int = Field(1, ge=1, le=1, description="Only one choice is generated")
    response_format: Optional[ResponseFormat] = Field(
        None, description="json_object or json_schema: the reply is constrained to it (llm's --schema)"
    )
    user: Optional[str] = hint("an end-user id")
    metadata: Optional[dict[str, Any]] = hint("the client's bookkeeping")
    store: Optional[bool] = hint("replies are not stored for later retrieval on this route")
    service_tier: Optional[str] = hint("one tier here")
    prompt_cache_key: Optional[str] = hint("the KV cache is reused for any matching prefix")
    safety_identifier: Optional[str] = hint("an end-user id")
    verbosity: Optional[str] = hint("the model's own length")
    prediction: Optional[dict[str, Any]] = hint("a latency hint for predicted outputs")
    presence_penalty: Optional[float] = Field(None, description="Only 0")
    frequency_penalty: Optional[float] = Field(None, description="Only 0")
    logit_bias: Optional[dict[str, float]] = Field(None, description="Only {}")

    @model_validator(mode="after")
    def _refuse_what_is_not_implemented(self):
        for name, allowed in NO_OP_FIELDS.items():
            value = getattr(self, name, None)
            if not any(value == a for a in allowed):
                raise ValueError(f"{name} {value!r} is not supported by this server "
                                 f"(accepted: {', '.join(repr(a) for a in allowed if a is not None)})")
        return self

    def plugin_options(self) -> dict:
        """The plugin's options the request sets, as the reply core takes them."""
        fields = options_set(self, engine_option_names())
        if self.max_completion_tokens is not None and "max_tokens" not in fields:
            fields["max_tokens"] = self.max_completion_tokens
        return fields


class ChatCompletionRequest(_GenerationRequest):
    messages: list[OpenAIMessage] = Field(min_length=1)
    logprobs: Optional[bool] = Field(None, description="true: each generated token's log-probability "
                                     "(choices[].logprobs; streamed: in the closing chunk)")
    tools: Optional[list[ToolSpec]] = Field(None, description="Functions the model may call; the calls "
                                            "are the reply (message.tool_calls), the client runs them")
    tool_choice: Optional[ToolChoice] = Field(
        None, description="auto (default), none (the tools are not shown to the model), required (a call "
        "to one of them) or {type: function, function: {name}} (a call to that one); required and a name "
        "are enforced by constrained decoding")
    parallel_tool_calls: Optional[bool] = Field(None, description="false: at most one call per reply")

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self):
        if self.top_logprobs and not self.logprobs:  # 0 is the no-op value
            raise ValueError("top_logprobs: needs logprobs true")
        return self

    def plugin_options(self) -> dict:
        fields = super().plugin_options()
        if "tool_choice" in fields:
            fields["tool_choice"] = choice_option(fields["tool_choice"])
        if self.logprobs:
            fields["top_logprobs"] = self.top_logprobs or 0
        else:
            fields.pop("top_logprobs", None)
        return fields


class CompletionRequest(_GenerationRequest):
    prompt: Union[str, list[str]] = Field(description="Raw text, encoded without the chat template")
    logprobs: Optional[int] = Field(None, ge=0, le=20, description="Each generated token's log-probability "
                                    "and this many most likely alternatives (choices[].logprobs)")
    suffix: Optional[str] = Field(None, description="Fill in the middle: the reply is what goes between the "
                                  "prompt and this text (through the model's FIM tokens; a 400 where it has none)")
    echo: Optional[bool] = Field(None, description="Only false")
    best_of: Optional[int] = Field(None, ge=1, le=1, description="Only 1")

    @model_validator(mode="after")
    def _no_echo(self):
        if self.echo:
            raise ValueError("echo true is not supported by this server (accepted: false)")
        return self

    def plugin_options(self) -> dict:
        fields = super().plugin_options()
        if self.logprobs is not None:
            fields["top_logprobs"] = self.logprobs
        return fields

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else "".join(self.prompt)


# -- responses (documented in the OpenAPI schema; streamed ones are SSE chunks) ----
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="The prompt tokens reused from the KV cache rather than prefilled")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[OpenAIToolCall]] = None


class BaseChoice(BaseModel):
    """What a chat and a text choice share."""

    index: int = 0
    finish_reason: Optional[str]
    logprobs: Optional[dict[str, Any]] = None


class ChatChoice(BaseChoice):
    message: AssistantMessage


class TextChoice(BaseChoice):
    text: str


class BaseCompletion(BaseModel):
    """What a chat completion and a text completion share."""

    id: str
    created: int
    model: str
    usage: Usage
    mlx_stream: dict[str, Any] = Field(
        description="Extension: the engine's figures (stats), the reply's token ids, the checkpoint"
    )


class ChatCompletion(BaseCompletion):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class Completion(BaseCompletion):
    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlx-stream"
    loaded: bool = Field(False, description="An extension: whether the model is loaded now (GET /api/ps says more)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: OpenAIErrorBody
