"""The package's imports point down its layers and never go round in a circle.

Every import counts, function-local ones included (they are read from the source with
`ast`, not from what happens to be imported at run time).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "llm_mlx_streaming"

# Higher layers may import lower ones; a layer's parts may import each other
# (without a circle between packages).
LAYERS = [
    {"(hooks)"},
    {"cli", "server"},  # the doors: `llm mlxs ...` and the HTTP APIs
    {"plugin"},  # llm's model: maps the reply core's events to llm's
    {"client"},  # a running server, as a source of the core's events
    {"reply"},  # the reply core: messages and options -> engine -> events
    {"prompt"},  # messages, chat templates, tools, constraints
    {"options", "discovery", "pictures"},  # knobs -> settings, registry -> RunConfig | a running server's file | plots
    {"distributed"},
    {"engine"},
    {"speculation"},
    {"experts", "checkpoints", "formats"},  # the expert pool and store | reading checkpoints | tool-call formats
    {"processors", "values", "stops", "errors", "sizes", "syncs", "activity"},
]

# Arrows that point up (known knots, to be untied): none, and none may be added.
KNOWN_UPWARD: set = set()
KNOWN_PACKAGE_CYCLES: set = set()


def _modules() -> dict[str, Path]:
    out = {}
    for file in PACKAGE.rglob("*.py"):
        parts = list(file.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = file
    return out


def _imports(name: str, file: Path, modules: dict) -> set[str]:
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, file, modules) for name, file in modules.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(hooks)"


def _rank(part: str) -> int:
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i
    raise AssertionError(f"{part} is in no layer of LAYERS: place it")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_function_local_imports():
    graph = _graph()
    assert "llm_mlx_streaming.engine.loading" in graph["llm_mlx_streaming.engine.provider"]  # imported in load()


def test_no_module_imports_itself_round_a_circle():
    assert _cycles(_graph()) == []


def test_every_arrow_between_packages_points_down():
    graph = _graph()
    upward, packages = set(), {}
    for module, targets in graph.items():
        for target in targets:
            a, b = _part(module), _part(target)
            if a != b:
                if _rank(a) > _rank(b):
                    upward.add((a, b))
                else:
                    packages.setdefault(a, set()).add(b)
    assert upward <= KNOWN_UPWARD, sorted(upward - KNOWN_UPWARD)
    cycles = {frozenset(c) for c in _cycles(packages)}  # among the downward and sideways arrows
    assert cycles <= KNOWN_PACKAGE_CYCLES, cycles


def test_the_settings_import_nothing_of_the_engine():
    """The knobs and the settings file are read by every layer above the engine; they
    check values with values.py, which the engine shares."""
    graph = _graph()
    for module in ("llm_mlx_streaming.options.settings", "llm_mlx_streaming.options.knobs", "llm_mlx_streaming.values"):
        reached = {_part(t) for t in graph[module]}
        assert not reached & {"engine", "speculation", "server", "cli"}, (module, reached)


def test_no_server_module_imports_llm():
    """The server drives the reply core; it never goes through llm's models to reach
    its own engine (llm's message types come in through prompt/)."""
    for file in (PACKAGE / "server").rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not any(n == "llm" or n.startswith("llm.") for n in names), file


def test_the_package_ships_no_test_fixtures():
    """The checkpoint factory and scripted drafters live in fixtures/, outside the wheel;
    nothing installed may import them."""
    for file in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not any(n == "fixtures" or n.startswith("fixtures.") for n in names), file
    assert not {"factory.py", "architectures.py", "tokenizer.py", "scripted.py"} & {
        f.name for f in PACKAGE.rglob("*.py")}


def test_no_two_classes_share_a_name():
    """One name, one class: a reader (and an import) never has to ask which `Shape`."""
    where: dict[str, list[str]] = {}
    for file in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(file.relative_to(PACKAGE)))
    assert {name: files for name, files in where.items() if len(files) > 1} == {}


# The repository's folders, each above the ones after it: tests run everything;
# benchmarks, the conformance matrices and the tools build on the fixtures; the fixtures
# on the package, which imports none of them.
REPOSITORY = PACKAGE.parent
FOLDERS = [{"tests"}, {"benchmarks", "conformance", "tools"}, {"fixtures"}, {"llm_mlx_streaming"}]
# Sideways arrows among the middle folders that are meant: the recorder installs and
# runs the agent CLIs as the conformance matrices do (conformance/agent_clis.py).
KNOWN_SIDEWAYS = {("tools", "conformance")}


def _folder_of(name: str, importer: Path) -> str | None:
    """The repository folder an import reaches: by its package, or, for a script's bare
    import of a module beside it (they put their own folder on sys.path), its folder."""
    top = name.split(".")[0]
    if any(top in layer for layer in FOLDERS):
        return top
    if (importer.parent / f"{top}.py").exists():
        return importer.relative_to(REPOSITORY).parts[0]
    return None


def test_the_repositorys_folders_import_down_their_layers():
    rank = {folder: i for i, layer in enumerate(FOLDERS) for folder in layer}
    arrows = set()
    for folder in rank:
        for file in (REPOSITORY / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                arrows |= {(folder, target) for n in names if (target := _folder_of(n, file)) not in (None, folder)}
    wrong = {(a, b) for a, b in arrows if rank[a] >= rank[b] and (a, b) not in KNOWN_SIDEWAYS}
    assert wrong == set()
    assert ("tools", "conformance") in arrows and ("conformance", "fixtures") in arrows  # the walk sees them
