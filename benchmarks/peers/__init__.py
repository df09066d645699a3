"""Our streaming engine against BigRig and boyle on the same synthetic checkpoint
(`python benchmarks/peers --help`; the method is in __main__.py's docstring)."""
