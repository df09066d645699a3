"""Request bodies of Ollama's API (`/api/chat`, `/api/generate`, `/api/show`).

Ollama's `options` that map onto this engine are declared under Ollama's names
(num_predict, repeat_penalty, ...) beside the engine options under their own names
(expert_slots, k, ...; from knobs.py); Ollama's sampling options that would change
the reply are accepted only at their no-op value, its options for the hardware are
declared hints (fields.py: accepted and named back), and an engine option given under
the plugin's name where Ollama has its own is a 400 naming Ollama's.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import AliasChoices, Field, field_validator, model_validator

from ...options.knobs import BY_NAME, REPETITION_CONTEXT
from ..openai.tools import ToolSpec
from ..fields import RequestModel, hint, options_model, options_set
from ..keep_alive import KeepAlive

# Engine options this API has under its own name: max_tokens is num_predict, repetition_penalty
# is repeat_penalty, max_context is num_ctx, thinking and top_logprobs are top-level fields;
# tool_choice has no Ollama spelling.
RENAMED = {"max_tokens": "options.num_predict", "repetition_penalty": "options.repeat_penalty",
           "max_context": "options.num_ctx", "thinking": "think", "reasoning_effort": "think",
           "top_logprobs": "top_logprobs at the top level",
           "tool_choice": "no Ollama field (every tool may be called)",
           "parallel_tool_calls": "no Ollama field (calls may be parallel)"}
IMAGES = "Base64 images (PNG, JPEG, WebP, GIF), for a model that takes images; they come before the text"
HARDWARE = "this engine places the model itself (memory_budget, expert_slots)"
NO_OP_OPTIONS = {"repeat_last_n": (REPETITION_CONTEXT,), "presence_penalty": (0,), "frequency_penalty": (0,),
                 "typical_p": (1,), "tfs_z": (1,), "mirostat": (0,)}

OllamaEngineOptions = options_model("OllamaEngineOptions", exclude=RENAMED)


class Options(OllamaEngineOptions):
    num_predict: Optional[int] = Field(None, ge=-2, description="Most tokens generated; -1 or -2: until the "
                                       "context (max_context) is full")
    repeat_penalty: Optional[float] = Field(None, description=BY_NAME["repetition_penalty"].description,
                                            **BY_NAME["repetition_penalty"].bounds)
    num_ctx: Optional[int] = Field(None, ge=1, description="The context of this request, at most the "
                                   "server's max_context (the KV cache is planned for that)")
    repeat_last_n: Optional[int] = Field(None, description=f"Only {REPETITION_CONTEXT}, the window of repeat_penalty")
    presence_penalty: Optional[float] = Field(None, description="Only 0")
    frequency_penalty: Optional[float] = Field(None, description="Only 0")
    typical_p: Optional[float] = Field(None, description="Only 1")
    tfs_z: Optional[float] = Field(None, description="Only 1")
    mirostat: Optional[int] = Field(None, description="Only 0")
    num_gpu: Optional[int] = hint(HARDWARE)
    main_gpu: Optional[int] = hint(HARDWARE)
    num_thread: Optional[int] = hint(HARDWARE)
    num_batch: Optional[int] = hint("the prefill chunk is prefill_step")
    low_vram: Optional[bool] = hint(HARDWARE)
    use_mmap: Optional[bool] = hint(HARDWARE)
    use_mlock: Optional[bool] = hint(HARDWARE)
    numa: Optional[bool] = hint(HARDWARE)
    num_keep: Optional[int] = hint("the whole prompt is kept")
    penalize_newline: Optional[bool] = hint("repeat_penalty applies to every token")

    @field_validator("num_predict")
    @classmethod
    def _generates_something(cls, value):
        if value == 0:
            raise ValueError("0 generates nothing; -1 or -2: until the context is full")
        return value

    @model_validator(mode="after")
    def _no_ops_only(self):
        for name in self.model_extra or {}:
            if name in RENAMED:
                raise ValueError(f"{name}: this API's field is {RENAMED[name]}")
        for name, allowed in NO_OP_OPTIONS.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"{name} {value!r} is not supported by this server (accepted: {allowed[0]})")
        return self

    def plugin_options(self) -> dict:
        """The plugin's options these set."""
        fields = options_set(self, OllamaEngineOptions.model_fields)
        if self.num_predict is not None:
            fields["max_tokens"] = -1 if self.num_predict < 0 else self.num_predict
        if self.repeat_penalty is not None:
            fields["repetition_penalty"] = self.repeat_penalty
        if self.num_ctx is not None:
            fields["max_context"] = self.num_ctx
        return fields


class _Generation(KeepAlive):
    model: str = Field(min_length=1, description="A model from /api/tags")
    stream: bool = Field(True, description="NDJSON chunks (the default), or one body with false")
    format: Union[Literal["", "json"], dict[str, Any], None] = Field(
        None, description="json or a JSON schema: the reply is constrained to it")
    options: Optional[Options] = None
    think: Union[bool, Literal["low", "medium", "high"], None] = Field(
        None, description="The chat template's thinking switch, or gpt-oss's reasoning effort; the reasoning "
        "comes as `thinking`")
    logprobs: Optional[bool] = Field(None, description="true: each generated token's log-probability "
                                     "(`logprobs`; streamed: in the last line)")
    top_logprobs: Optional[int] = Field(None, ge=0, le=20, description="With logprobs: this many most likely "
                                        "alternatives of each token")

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs true")
        return self

    def schema_dict(self) -> Optional[dict]:
        if self.format == "json":
            return {"type": "object"}
        return self.format or None

    def plugin_options(self) -> dict:
        """The plugin's options the request sets: its `options` and its own fields
        (think, logprobs) in the plugin's terms."""
        fields = self.options.plugin_options() if self.options else {}
        if isinstance(self.think, bool):
            fields["thinking"] = self.think
        elif self.think is not None:
            fields["reasoning_effort"] = self.think
        if self.logprobs:
            fields["top_logprobs"] = self.top_logprobs or 0
        return fields


class OllamaCalledFunction(RequestModel):
    name: str
    arguments: dict[str, Any]
    index: Optional[int] = None


class OllamaToolCall(RequestModel):
    function: OllamaCalledFunction


class OllamaMessage(RequestModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: Optional[str] = Field(None, description="An assistant message's reasoning")
    tool_calls: Optional[list[OllamaToolCall]] = None
    tool_name: Optional[str] = Field(None, description="A tool message's tool")
    images: Optional[list[str]] = Field(None, description=IMAGES)

    @model_validator(mode="after")
    def _fields_of_its_role(self):
        if self.images and self.role != "user":
            raise ValueError("images: only in a user message")
        if (self.tool_calls or self.thinking) and self.role != "assistant":
            raise ValueError("tool_calls and thinking: only in an assistant message")
        if self.tool_name is not None and self.role != "tool":
            raise ValueError("tool_name: only in a tool message")
        return self


class ChatRequest(_Generation):
    messages: list[OllamaMessage] = Field(default_factory=list, description="None: load the model (or unload "
                                    "it, with keep_alive 0)")
    tools: Optional[list[ToolSpec]] = None


class GenerateRequest(_Generation):
    prompt: str = Field("", description="Empty: load the model (or unload it, with keep_alive 0)")
    system: Optional[str] = None
    raw: bool = Field(False, description="true: the prompt is encoded as it is, without the chat template")
    images: Optional[list[str]] = Field(None, description=IMAGES)

    @model_validator(mode="after")
    def _raw_alone(self):
        if self.raw and self.system is not None:
            raise ValueError("system: a raw prompt has no template to put it in")
        if self.raw and self.images:
            raise ValueError("images: a raw prompt has no template to put them in")
        return self


class ShowRequest(RequestModel):
    model: str = Field(min_length=1, validation_alias=AliasChoices("model", "name"),
                       description="The model (`name`, Ollama's older spelling, as litellm sends it, too)")
    verbose: Optional[bool] = Field(None, description="Accepted; the answer is the same (no tensor list)")


class OllamaError(RequestModel):
    error: str
