"""OpenAI's chat completions, completions and models routes."""
