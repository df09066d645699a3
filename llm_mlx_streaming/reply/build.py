"""The prompt half of a reply: the run configuration's tokenizer renders the messages
and tools into token ids, with the logits processors that constrain what may follow.
Counting a prompt's tokens is this half alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..engine.request import Request
from ..errors import MlxStreamError
from ..options.knobs import REPETITION_CONTEXT
from ..options.run_config import RunConfig
from ..prompt.constrained import GrammarLead, SchemaError, SchemaProcessor, schema_grammar, text_grammar
from ..prompt.vision import has_images, render_with_images
from ..prompt.messages import NoImages, PromptError
from ..prompt.render import encode_text, fill_in_the_middle, raw_text, render_prompt
from ..prompt.split import opens_thinking, reasoning_of
from ..prompt.tools import (AUTO, NONE, ToolError, answer_or_call_grammar, check_tool_choice,
                            forced_call_grammar, shown_tools)


@dataclass(frozen=True)
class Ask:
    """One request to the core, whichever door it came through."""

    model: Optional[str]  # a registered name; None: the default model
    messages: Sequence  # llm's `Message`s (llm.parts)
    options: Any  # the plugin's `Options`
    tools: Sequence[dict] = ()  # function specs, as chat templates take them
    schema: Optional[dict] = None  # a JSON schema the reply must follow
    grammar: Optional[tuple[str, str]] = None  # (lark | regex, definition) the whole reply must follow
    suffix: Optional[str] = None  # fill in the middle: the reply goes between the (raw) prompt and this


@dataclass(frozen=True)
class Prepared:
    """What the engine is handed for one ask, rendered with the checkpoint's tokenizer."""

    request: Request
    generation_prompt: str  # the template's text after the last message (it may open a thinking block)
    tools: list[dict]  # the function specs the template was shown
    schema_check: tuple = ()  # the --schema processor, asked at the end whether the document closed


def grammar_of(ask: Ask) -> Optional[str]:
    """The llguidance grammar the reply must follow (its schema's or its own), compiled
    before anything is loaded; one line if it cannot be."""
    try:
        if ask.grammar is not None:
            return text_grammar(*ask.grammar)
        return schema_grammar(ask.schema) if ask.schema is not None else None
    except SchemaError as exc:
        raise MlxStreamError(f"--schema: {exc}" if ask.grammar is None else str(exc)) from None


def prepare(tokenizer, run: RunConfig, ask: Ask, grammar: Optional[str]) -> Prepared:
    """Render `ask` for the engine: token ids, processors, stops."""
    options = ask.options
    tools = list(ask.tools)
    forced = _forcing(tokenizer, tools, options, grammar)
    tools = shown_tools(tools, options.tool_choice)
    vision = None
    if ask.suffix is not None:
        tokens, generation_prompt, boundaries = fill_in_the_middle(tokenizer, raw_text(ask.messages), ask.suffix), "", ()
    elif _with_images(tokenizer, ask):
        if tools:
            raise PromptError("tools and images in one prompt are not supported yet")
        tokens, generation_prompt, vision = render_with_images(tokenizer, ask.messages, thinking=options.thinking,
                                                              effort=options.reasoning_effort)
        boundaries = ()
    else:
        try:
            tokens, generation_prompt, boundaries = render_prompt(tokenizer, ask.messages, thinking=options.thinking,
                                                                  effort=options.reasoning_effort, tools=tools)
        except NoImages as e:
            raise PromptError(f"{run.name} {e}") from None
    processors = repetition_processors(run.repetition_penalty)
    if options.thinking_budget and options.thinking is not False:
        processors += _reasoning_cap(tokenizer, tokens, generation_prompt, options.thinking_budget, run.max_tokens,
                                     tools if forced is None else [])
    if forced is not None:
        grammar = forced(generation_prompt)
    budget_aware = (SchemaProcessor(grammar, tokenizer),) if grammar is not None else ()
    request = run.request(tokens, [*processors, *budget_aware], budget_aware)
    request.vision, request.boundaries = vision, boundaries
    end_tag = tokenizer.tool_call_end if tools else None
    if end_tag and options.parallel_tool_calls is False:  # the reply ends with its first call
        request.stop = (*request.stop, end_tag)
    return Prepared(request, generation_prompt, tools, budget_aware if ask.schema is not None else ())


def _with_images(tokenizer, ask: Ask) -> bool:
    """Whether `ask` is rendered by the vision model's processor: it has images, and the
    tokenizer carries a processor (a text-only model's refuses them in render_prompt)."""
    return getattr(tokenizer, "vision", None) is not None and has_images(ask.messages)


def count(tokenizer, ask: Ask) -> int:
    """The prompt's tokens, rendered as a generation would render them."""
    tools = shown_tools(list(ask.tools), ask.options.tool_choice)
    if _with_images(tokenizer, ask):
        return len(render_with_images(tokenizer, ask.messages, thinking=ask.options.thinking,
                                      effort=ask.options.reasoning_effort)[0])
    tokens, _, _ = render_prompt(tokenizer, ask.messages, thinking=ask.options.thinking,
                                 effort=ask.options.reasoning_effort, tools=tools or None)
    return len(tokens)


def repetition_processors(penalty: float) -> list:
    """mlx-lm's repetition penalty as a logits processor, when it is on. It is a
    deterministic function of the logits and the history, so decoding stays exact at
    every pool size and under speculation (it is `Stateless`)."""
    if penalty == 1.0:
        return []
    from mlx_lm.sample_utils import make_logits_processors

    from ..processors import Stateless

    return [Stateless(p) for p in make_logits_processors(repetition_penalty=penalty,
                                                          repetition_context_size=REPETITION_CONTEXT)]


def _reasoning_cap(tokenizer, tokens: list[int], generation_prompt: str, budget: int, max_tokens: int,
                   tools: list[dict]) -> list:
    """[the processor that closes the reasoning after `budget` tokens with the format's
    own closing tokens], or [] where a budget cannot bind: the model marks no reasoning,
    or a reply of `max_tokens` ends before the budget, the closing tokens and a token of
    answer (Claude Code's budget of 31999 in 32000). Where the format writes its answer
    behind a header (harmony) and the model has `tools`, only the reasoning's end is
    forced: the model then chooses the answer or a call, under a grammar of both."""
    from ..processors import reasoning_cap

    found = reasoning_of(tokenizer)
    if found is None:
        return []
    end, answer = encode_text(tokenizer, found.end), encode_text(tokenizer, found.answer)
    if max_tokens >= 1 and budget + len(end) + len(answer) >= max_tokens:
        return []
    opened, start = opens_thinking(generation_prompt, found.start, found.end), encode_text(tokenizer, found.start)
    grammar = answer_or_call_grammar(tokenizer, tools, found.answer, generation_prompt) if answer and tools else None
    if grammar is not None:
        return [reasoning_cap(len(tokens), opened, start, end, [], budget, GrammarLead(grammar, tokenizer))]
    return [reasoning_cap(len(tokens), opened, start, end, answer, budget)]


def _forcing(tokenizer, tools: list[dict], options, grammar):
    """What builds the grammar of the tool call `options.tool_choice` forces, once the
    generation prompt is known (it may open a think block), or None."""
    if options.tool_choice in (None, AUTO, NONE):
        return None
    check_tool_choice(options.tool_choice, tools)
    if grammar:
        raise ToolError("a schema and a forced tool call (tool_choice) cannot be combined")
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    return lambda generation_prompt: forced_call_grammar(
        tokenizer, tools, options.tool_choice, options.parallel_tool_calls,
        thinking=opens_thinking(generation_prompt, start, end))
