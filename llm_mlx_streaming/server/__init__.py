"""`llm mlxs serve`: the engine kept warm in one process behind the OpenAI, Anthropic and
Ollama APIs.

schemas.py holds the OpenAI request and response bodies, gate.py the queue (max_batch at once),
runtime.py the parameters a running server can change, bridge.py runs the plugin's own
prompt path (its async model) as a task on the event loop, turns.py takes one generation
through the gate and answers it in an API's shape, service.py the server's state and the
OpenAI routes (with http_layer.py, reply_memory.py and shapes.py for errors, messages in
and replies out); anthropic*.py and ollama*.py are the other two APIs, catalog.py the
models they list, counting.py a prompt's tokens; run.py the process. The file that tells
`llm` a server runs, and the `llm` side, live below the model in client/.
"""
