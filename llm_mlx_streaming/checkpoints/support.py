"""Which of the installed mlx-lm's MoE modules the engine streams, and why not the others.

The MoE modules are found in mlx-lm itself (`moe_modules`), so a module a new mlx-lm adds
is noticed (tests/test_matrix.py fails until it is classified). UNSUPPORTED is the one
list of refusals, mirrored in docs/architecture.md; `check_checkpoint` refuses those
architectures in one line naming the reason.
"""

from __future__ import annotations

import functools
import re

UNSUPPORTED = {
    "bailing_moe_linear": "mlx-lm 0.32.2 cannot run it: its model calls "
                          "create_attention_mask() without return_array and window_size",
    "dbrx": "experts are a Python list of per-expert MLPs (dbrx.SparseMoeBlock), "
            "not a stacked switch container the engine can stream",
    "muse_spark": "mlx-lm 0.32.2 runs it only through Metal kernels (kernels/qk_norm_rope), "
                  "so stock output cannot be checked on the CPU backend the matrix runs on",
}

# A module is MoE if its source builds a switch container or counts experts.
_MOE_SOURCE = re.compile(r"switch_layers|experts", re.IGNORECASE)


@functools.lru_cache(maxsize=1)
def moe_modules() -> tuple[str, ...]:
    """Names of the installed mlx-lm's model modules that hold experts, sorted."""
    import importlib.util
    import pkgutil

    import mlx_lm.models as models

    found = []
    for info in pkgutil.iter_modules(models.__path__):
        if info.name == "switch_layers" or info.ispkg:
            continue
        spec = importlib.util.find_spec(f"mlx_lm.models.{info.name}")
        source = open(spec.origin, encoding="utf-8").read()
        if _MOE_SOURCE.search(source) and "class ModelArgs" in source:
            found.append(info.name)
    return tuple(sorted(found))


def model_module(config: dict) -> str:
    """The mlx-lm module that builds `config`, resolved as mlx_lm.load resolves it."""
    from .classes import model_classes

    return model_classes(config)[0].__module__.rpartition(".")[2]


def unsupported_reason(config: dict) -> str | None:
    """Why the engine refuses this config's architecture, or None."""
    return UNSUPPORTED.get(model_module(config))


@functools.lru_cache(maxsize=None)
def cached_array_reads(module: str) -> tuple[str, ...]:
    """What the module's code reads off the keys or values a cache hands back, such as
    `values.dtype`: a quantized cache hands back tuples, which have none of it.

    Read from the source (ast): in each function, an attribute of a name assigned from
    `update_and_fetch(...)`, read after that assignment.
    """
    import ast
    import importlib.util

    spec = importlib.util.find_spec(f"mlx_lm.models.{module}")
    tree = ast.parse(open(spec.origin, encoding="utf-8").read())
    found = []
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        fetched = {}
        for node in ast.walk(function):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "attr", None) == "update_and_fetch"):
                for target in node.targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            fetched[name.id] = min(fetched.get(name.id, node.lineno), node.lineno)
        for node in ast.walk(function):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.attr in ("dtype", "shape") and node.value.id in fetched
                    and node.lineno > fetched[node.value.id]):
                found.append(f"{node.value.id}.{node.attr}")
    return tuple(dict.fromkeys(found))
