"""`llm mlxs serve`: the engine kept warm in one process behind the OpenAI, Anthropic and
Ollama APIs.

app.py builds the ASGI app (guard, body limit, errors, the server's own routes), service.py
holds its state, gate.py the queue (max_batch at once), runtime.py the parameters a
running server can change, turns.py takes one request through the gate and the reply
core and answers it in an API's shape. Each API has its folder (openai/, anthropic/,
ollama/: routes, schemas, shapes); process/ runs the server, supervises a pipeline of
ranks and stands in while they restart.
"""
