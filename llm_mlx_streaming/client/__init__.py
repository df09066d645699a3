"""The `llm` side of a running server: client.py sends it a prompt (read back as the reply
core's events), a setting or a stats request. Below the plugin, so the plugin can route a
prompt to a server without importing the server."""
