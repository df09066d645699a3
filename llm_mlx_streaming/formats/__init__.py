"""Tool-call formats: how each model family writes its calls, found from the checkpoint.

One module per format (a `FORMAT`), registered in `registry.py`; mlx-lm's parser where
it has one, a parser of ours (written like mlx-lm's `tool_parsers/`) where it has none.
"""
