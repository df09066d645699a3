"""llm's side: the `llm.Model` and its async twin over the reply core, and llm's logs.db."""
