"""One turn of a Python client library, run by conformance/clients.py in the clients' venv
(conformance/.cache/clients-venv), where this checkout's package is not installed:

    python -P client_drivers.py CLIENT BASE_URL STATE_FILE PROMPT

(-P: not this folder on sys.path, where conformance/agents.py would shadow openai-agents'
package `agents`.)

It reads the conversation so far from STATE_FILE (absent on the first turn), sends
PROMPT as the next user turn the way the library's users do, prints the reply and
writes the conversation back. A failure is one line on stderr and exit status 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODEL = "mlx-stream/agents"
KEY = "sk-unused"  # the server takes any key: it was started without --api-key
TIMEOUT = 120  # seconds per request
MAX_TOKENS = 64


def litellm_turn(provider: str, stream: bool):
    def turn(url: str, history: list, prompt: str) -> tuple[list, str]:
        import litellm

        messages = [*history, {"role": "user", "content": prompt}]
        reply = litellm.completion(model=f"{provider}/{MODEL}", api_base=f"{url}/v1" if provider == "openai" else url,
                                   api_key=KEY, messages=messages, max_tokens=MAX_TOKENS, stream=stream,
                                   timeout=TIMEOUT, num_retries=0)
        if stream:
            text = "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
        else:
            text = reply.choices[0].message.content
        return [*messages, {"role": "assistant", "content": text}], text

    return turn


def openai_agents_turn(api: str):
    def turn(url: str, history: list, prompt: str) -> tuple[list, str]:
        from agents import (Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                            set_tracing_disabled)
        from openai import AsyncOpenAI

        set_tracing_disabled(True)

        @function_tool
        def get_weather(city: str) -> str:
            """The current weather in a city."""
            return f"It is sunny in {city}."

        client = AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
        model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        agent = Agent(name="Assistant", instructions="You are a helpful assistant. Use tools when useful.",
                      tools=[get_weather], model=model_class(model=MODEL, openai_client=client))
        result = Runner.run_sync(agent, [*history, {"role": "user", "content": prompt}], max_turns=4)
        return result.to_input_list(), result.final_output

    return turn


def langchain_turn(api: str):
    def turn(url: str, history: list, prompt: str) -> tuple[list, str]:
        if api == "ollama":
            from langchain_ollama import ChatOllama

            chat = ChatOllama(model=MODEL, base_url=url, num_predict=MAX_TOKENS)
        else:
            from langchain_openai import ChatOpenAI

            chat = ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key=KEY, max_tokens=MAX_TOKENS,
                              timeout=TIMEOUT, max_retries=0)
        messages = [*history, {"role": "user", "content": prompt}]
        text = chat.invoke([(m["role"], m["content"]) for m in messages]).content
        return [*messages, {"role": "assistant", "content": text}], text

    return turn


def pydantic_ai_turn(url: str, history: list, prompt: str) -> tuple[list, str]:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessagesTypeAdapter
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    agent = Agent(OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{url}/v1", api_key=KEY)),
                  instructions="You are a helpful assistant.")

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"It is sunny in {city}."

    result = agent.run_sync(prompt, message_history=ModelMessagesTypeAdapter.validate_python(history))
    return json.loads(result.all_messages_json()), result.output


def ollama_turn(url: str, history: list, prompt: str) -> tuple[list, str]:
    import ollama

    messages = [*history, {"role": "user", "content": prompt}]
    reply = ollama.Client(host=url, timeout=TIMEOUT).chat(model=MODEL, messages=messages,
                                                          options={"num_predict": MAX_TOKENS})
    text = reply.message.content
    return [*messages, {"role": "assistant", "content": text}], text


def openai_turn(url: str, history: list, prompt: str) -> tuple[list, str]:
    from openai import OpenAI

    messages = [*history, {"role": "user", "content": prompt}]
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
    text = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS).choices[0].message.content
    return [*messages, {"role": "assistant", "content": text}], text


def anthropic_turn(url: str, history: list, prompt: str) -> tuple[list, str]:
    from anthropic import Anthropic

    messages = [*history, {"role": "user", "content": prompt}]
    client = Anthropic(base_url=url, api_key=KEY, timeout=TIMEOUT, max_retries=0)
    reply = client.messages.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
    text = "".join(block.text for block in reply.content if block.type == "text")
    return [*messages, {"role": "assistant", "content": text}], text


DRIVERS = {
    **{f"litellm-{provider}{'-stream' if stream else ''}": litellm_turn(provider, stream)
       for provider in ("openai", "anthropic", "ollama_chat", "ollama") for stream in (False, True)},
    "openai-agents-responses": openai_agents_turn("responses"),
    "openai-agents-chat": openai_agents_turn("chat"),
    "langchain-openai": langchain_turn("openai"),
    "langchain-ollama": langchain_turn("ollama"),
    "pydantic-ai": pydantic_ai_turn,
    "ollama": ollama_turn,
    "openai": openai_turn,
    "anthropic": anthropic_turn,
}


def main(client: str, url: str, state_file: str, prompt: str) -> int:
    state = Path(state_file)
    history = json.loads(state.read_text()) if state.exists() else []
    try:
        conversation, text = DRIVERS[client](url, history, prompt)
    except Exception as e:  # the row's one line
        message = " ".join(str(e).split()) or "(no message)"
        print(f"{type(e).__name__}: {message}", file=sys.stderr)
        return 1
    state.write_text(json.dumps(conversation))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
