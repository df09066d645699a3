"""How many tokens a conversation is, rendered exactly as a generation would render it
(the chat template, its thinking switch, the tools), without generating."""

from __future__ import annotations

from typing import Sequence

from ..errors import MlxStreamError
from ..run_config import resolve
from ..settings import load_settings


def prompt_tokens(model_id: str, messages: list, options: dict, tools: Sequence = ()) -> int:
    """The prompt's token count for `model_id` with `tools` (llm `Tool`s) (blocking: the
    tokenizer may have to load)."""
    import llm

    from ..engine.manager import EngineError, LoadError, get_manager
    from ..messages import PromptError
    from ..model import Options
    from ..prompting import render_prompt
    from ..tools import ToolError, shown_tools, template_tools

    model = llm.get_model(model_id)
    values = Options.model_validate(options)
    run = resolve(model.name, values, load_settings())
    try:
        tokenizer = get_manager().tokenizer_for(run.load).tokenizer
        prompt = llm.Prompt(None, model, messages=messages)
        shown = shown_tools(template_tools(tools), values.tool_choice)
        tokens, _ = render_prompt(tokenizer, prompt, thinking=values.thinking, tools=shown or None)
    except (EngineError, LoadError, PromptError, ToolError) as e:
        raise MlxStreamError(str(e)) from None
    return len(tokens)
