"""The `llm` side of a running server: discovery.py finds it (the file `llm mlxs serve`
writes), client.py sends it a prompt, a setting or a stats request.

Below the model, so the plugin can route a prompt to a server without importing the
server (which sits above the model and imports it).
"""
