"""Tool-call formats: how each model family writes its calls, found from the checkpoint.

One module per format (a `FORMAT`), found by `registry.py` among this package's modules
(nothing registers it); mlx-lm's parser where it has one, a parser of ours (written like
mlx-lm's `tool_parsers/`) where it has none. A family no module and no parser of mlx-lm's
knows gets a format learned from its chat template (`learning.py` finds it, `learned.py`
makes it a format). The three layers every format is made of are modules of their own:
what a format is (`tool_format.py`), reading its calls while they are written
(`reading.py`), and forcing one (`forcing.py`). docs/formats.md tells it whole.
"""
