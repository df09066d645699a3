"""OpenAI's Responses API (`/v1/responses`): what Codex and the openai-agents SDK speak."""
