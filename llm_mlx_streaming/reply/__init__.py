"""The reply core: one request, from messages and options to the engine and back as
the plugin's own events, the same for every door (llm's model, each HTTP API, the
client of a running server)."""
