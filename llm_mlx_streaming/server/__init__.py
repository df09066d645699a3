"""`llm mlxs serve`: the engine kept warm in one process behind an OpenAI-compatible API.

schemas.py holds the request and response bodies, gate.py the one-at-a-time queue,
runtime.py the parameters a running server can change, bridge.py runs the plugin's own
prompt path (its async model) as a task on the event loop, service.py the routes
(with http_layer.py, reply_memory.py and shapes.py for errors, messages in and replies out),
run.py the process. The file that tells `llm` a server runs, and the `llm` side, live
below the model in client/.
"""
