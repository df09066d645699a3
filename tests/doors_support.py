"""One turn through each door of `llm mlxs serve`, read with the API's official client,
whole or streamed, as (text, reasoning, calls, finish), and the next turn that answers
its calls in that API's own shape: for tests that hold every door to the same reply.

`calls` are [(name, arguments dict, streamed arguments' pieces)]: a streamed call's
pieces are the argument fragments as they came (their concatenation is JSON)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
ASK = "What is the weather in Paris, and the time there?"


@dataclass
class Turn:
    text: str = ""
    reasoning: str = ""
    calls: list = field(default_factory=list)  # [(id, name, arguments, pieces)]
    finish: str = ""

    def called(self) -> list[tuple[str, dict]]:
        return [(name, arguments) for _, name, arguments, _ in self.calls]


def _args(text: str) -> dict:
    return json.loads(text) if text else {}


# -- OpenAI chat completions ---------------------------------------------------------

def openai_chat(url: str, model: str, messages: list[dict], stream: bool, tools=TOOLS, **extra) -> Turn:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    kwargs = dict(model=model, messages=messages, tools=tools, **extra)
    turn = Turn()
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        turn.text = choice.message.content or ""
        turn.reasoning = (choice.message.model_extra or {}).get("reasoning_content") or ""
        turn.calls = [(c.id, c.function.name, _args(c.function.arguments), [c.function.arguments])
                      for c in choice.message.tool_calls or []]
        turn.finish = choice.finish_reason
        return turn
    calls: dict[int, list] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            turn.text += delta.content or ""
            turn.reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for d in delta.tool_calls or []:
                call = calls.setdefault(d.index, [None, "", []])
                call[0] = d.id or call[0]
                call[1] += (d.function.name or "") if d.function else ""
                if d.function and d.function.arguments:
                    call[2].append(d.function.arguments)
            turn.finish = choice.finish_reason or turn.finish
    turn.calls = [(c[0], c[1], _args("".join(c[2])), c[2]) for _, c in sorted(calls.items())]
    return turn


def openai_answered(messages: list[dict], turn: Turn, result: str) -> list[dict]:
    reply = {"role": "assistant", "content": turn.text or None,
             "tool_calls": [{"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                            for i, n, a, _ in turn.calls]}
    return [*messages, reply, *({"role": "tool", "tool_call_id": i, "content": result} for i, *_ in turn.calls)]


# -- OpenAI Responses -------------------------------------------------------------------

def _responses_tools(tools):
    return [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
             "parameters": t["function"]["parameters"]} for t in tools]


def responses(url: str, model: str, items: list, stream: bool, tools=TOOLS, **extra) -> Turn:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    kwargs = dict(model=model, input=items, tools=_responses_tools(tools), store=False, **extra)
    turn = Turn()
    if stream:
        pieces: dict[str, list] = {}
        final = None
        for event in client.responses.create(stream=True, **kwargs):
            if event.type == "response.function_call_arguments.delta":
                pieces.setdefault(event.item_id, []).append(event.delta)
            elif event.type == "response.completed":
                final = event.response
        response = final
    else:
        response, pieces = client.responses.create(**kwargs), {}
    for item in response.output:
        if item.type == "reasoning":
            turn.reasoning += "".join(p.text for p in (item.content or item.summary or []))
        elif item.type == "message":
            turn.text += "".join(p.text for p in item.content if p.type == "output_text")
        elif item.type == "function_call":
            turn.calls.append((item.call_id, item.name, _args(item.arguments),
                               pieces.get(item.id, [item.arguments])))
    turn.finish = response.status
    turn.output = response.output
    return turn


def responses_answered(items: list, turn: Turn, result: str) -> list:
    out = [*items]
    for item in turn.output:
        if item.type == "function_call":
            out.append({"type": "function_call", "call_id": item.call_id, "name": item.name,
                        "arguments": item.arguments})
    out += [{"type": "function_call_output", "call_id": i, "output": result} for i, *_ in turn.calls]
    return out


# -- Anthropic Messages ----------------------------------------------------------------

def _anthropic_tools(tools):
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in tools]


def anthropic(url: str, model: str, messages: list[dict], stream: bool, tools=TOOLS, **extra) -> Turn:
    import anthropic as sdk

    client = sdk.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
    kwargs = {"max_tokens": 256, **extra, "model": model, "messages": messages, "tools": _anthropic_tools(tools)}
    turn = Turn()
    pieces: dict[int, list] = {}
    if stream:
        with client.messages.stream(**kwargs) as events:
            for event in events:
                if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                    pieces.setdefault(event.index, []).append(event.delta.partial_json)
            reply = events.get_final_message()
    else:
        reply = client.messages.create(**kwargs)
    for i, block in enumerate(reply.content):
        if block.type == "thinking":
            turn.reasoning += block.thinking
        elif block.type == "text":
            turn.text += block.text
        elif block.type == "tool_use":
            turn.calls.append((block.id, block.name, block.input, pieces.get(i, [json.dumps(block.input)])))
    turn.finish = reply.stop_reason
    turn.content = [b.model_dump(exclude_none=True) for b in reply.content]
    return turn


def anthropic_answered(messages: list[dict], turn: Turn, result: str) -> list[dict]:
    results = [{"type": "tool_result", "tool_use_id": i, "content": result} for i, *_ in turn.calls]
    return [*messages, {"role": "assistant", "content": turn.content}, {"role": "user", "content": results}]


# -- Ollama -----------------------------------------------------------------------------

def ollama(url: str, model: str, messages: list[dict], stream: bool, tools=TOOLS, **extra) -> Turn:
    import ollama as sdk

    client = sdk.Client(host=url, timeout=120)
    turn = Turn()
    parts = client.chat(model=model, messages=messages, tools=tools, stream=stream, **extra)
    for part in (parts if stream else [parts]):
        message = part.message
        turn.text += message.content or ""
        turn.reasoning += message.thinking or ""
        for call in message.tool_calls or []:
            arguments = dict(call.function.arguments)
            turn.calls.append((None, call.function.name, arguments, [json.dumps(arguments)]))
        turn.finish = part.done_reason or turn.finish
    return turn


def ollama_answered(messages: list[dict], turn: Turn, result: str) -> list[dict]:
    reply = {"role": "assistant", "content": turn.text,
             "tool_calls": [{"function": {"name": n, "arguments": a}} for _, n, a, _ in turn.calls]}
    return [*messages, reply, *({"role": "tool", "content": result, "tool_name": n} for _, n, *_ in turn.calls)]


# Each door: (ask, answered, the first turn's request from a user's text)
DOORS = {
    "openai": (openai_chat, openai_answered, lambda text: [{"role": "user", "content": text}]),
    "responses": (responses, responses_answered, lambda text: [{"role": "user", "content": text}]),
    "anthropic": (anthropic, anthropic_answered, lambda text: [{"role": "user", "content": text}]),
    "ollama": (ollama, ollama_answered, lambda text: [{"role": "user", "content": text}]),
}
