"""`llm mlxs serve`: the engine kept warm in one process behind four APIs: OpenAI's chat
completions (and completions), OpenAI's Responses API, Anthropic's Messages and Ollama's.

app.py builds the ASGI app (guard, body limit, errors, the server's own routes), service.py
puts the server's parts together: policy.py (keys, model names, ignored fields),
hosting.py (the models it hosts, their limits and keep_alive), gate.py the queue
(max_batch at once), runtime.py the parameters a running server can change;
conversation.py the messages every API's request becomes, turns.py the one pipeline
that takes a request's record through the gate and the reply core and answers it in an
API's shape (shape.py: what every shape gives). Each API has its folder (openai/,
responses/, anthropic/, ollama/: routes, schemas, shapes); process/ runs the server,
supervises a pipeline of ranks and stands in while they restart.
"""
