"""A prompt in the model's own terms: llm's messages <-> chat-template tokens, tools and
their calls, the split of a streamed reply, schema constraints."""
