"""The floors of the house (STYLE.md): core/ < tasks/ < models/ < stages < pipeline/ < cli/; a floor imports only floors
below, and no module sits loose at the package root.

The stages (prune, evaluate, recover, analyze) are siblings that never import each other. Every import statement in
src/layerprune is read with ast, at module level and inside functions alike, and so is every string that names a class
for a later `importlib` look-up ('layerprune.pipeline.studies.sweep:SweepStudy'): an arrow all the same. Inside the
package nothing takes a name from the package face (`from layerprune import __version__`); the face imports the
floors.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
STAGES = ("prune", "evaluate", "recover", "analyze", "export", "posttrain")
FLOORS = {"core": 0, "tasks": 1, "models": 2, **dict.fromkeys(STAGES, 3), "pipeline": 4, "cli": 5}
LOOSE = -1  # a module at the package root other than the face: it has no floor, and the test below refuses it
FACADE = "layerprune"  # the package's own __init__ may export the stages' entry functions
NAMED_CLASS = re.compile(r"layerprune(?:\.\w+)*:\w+")  # 'module:Class', imported by name later


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else "loose"


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported layerprune module) for every import statement and 'module:Class' string of a module's source,
    wherever it stands."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.append((node.lineno, target if is_module(target) else base))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and NAMED_CLASS.fullmatch(node.value):
            found.append((node.lineno, node.value.partition(":")[0]))
    return [(line, name) for line, name in found if name == "layerprune" or name.startswith("layerprune.")]


def arrows() -> list[tuple[str, int, str]]:
    """(importer, line, imported) over every module of the package."""
    return [(module_name(path), line, target)
            for path in sorted((SRC / "layerprune").rglob("*.py"))
            for line, target in imports_of(path.read_text(encoding="utf-8"), module_name(path),
                                           path.name == "__init__.py")]


def goes_up_or_sideways(importer: str, target: str) -> bool:
    here, there = room(importer), room(target)
    return importer != FACADE and here != there and FLOORS.get(there, LOOSE) >= FLOORS.get(here, LOOSE)


def test_no_module_imports_a_floor_above_it_or_a_sibling_stage():
    bad = [f"{importer}:{line} imports {target}" for importer, line, target in arrows()
           if goes_up_or_sideways(importer, target)]
    assert not bad, "\n".join(bad)


def test_no_module_sits_loose_at_the_package_root():
    """Everything but the face lives on a floor (core/, tasks/, models/, ...); a newcomer finds a thing by its floor."""
    loose = sorted(path.name for path in (SRC / "layerprune").glob("*.py") if path.name != "__init__.py")
    assert not loose, f"modules at the package root, move each to its floor: {loose}"


def test_no_module_takes_a_name_from_the_package_face():
    """The face (`layerprune/__init__`) lends the floors' names to users; a module that borrows one back points up."""
    borrowed = [f"{importer}:{line} imports a name from {FACADE}" for importer, line, target in arrows()
                if target == FACADE and importer != FACADE]
    assert not borrowed, "\n".join(borrowed)


def test_every_layerprune_import_names_a_module_that_exists():
    """A function-level import of a moved module fails only when it runs; catch it here."""
    missing = [f"{importer}:{line} imports {target}" for importer, line, target in arrows() if not is_module(target)]
    assert not missing, "\n".join(missing)


def test_the_rule_sees_function_level_and_relative_imports_and_judges_arrows():
    source = ("from . import recipe\n\ndef f():\n    from layerprune.cli import main\n"
              "    import layerprune.core.errors\n")
    assert {t for _, t in imports_of(source, "layerprune.prune.api", False)} == {
        "layerprune.prune.recipe", "layerprune.cli", "layerprune.core.errors"}
    named = 'KINDS = {"sweep": "layerprune.pipeline.studies.sweep:SweepStudy", "note": "see layerprune.cli:main"}\n'
    assert imports_of(named, "layerprune.core.recipe_loading", False) == [(1, "layerprune.pipeline.studies.sweep")]
    assert imports_of("from layerprune import __version__\n", "layerprune.core.provenance", False) == [(1, FACADE)]
    assert goes_up_or_sideways("layerprune.prune.api", "layerprune.cli")
    assert goes_up_or_sideways("layerprune.analyze.walk", "layerprune.prune.forward")
    assert goes_up_or_sideways("layerprune.models.loading", "layerprune.recover.schema")
    assert goes_up_or_sideways("layerprune.core.recipe_loading", "layerprune.models")
    assert goes_up_or_sideways("layerprune.core.errors", "layerprune.tasks.probes")
    assert goes_up_or_sideways("layerprune.tasks.probes", "layerprune.models.loading")
    assert not goes_up_or_sideways("layerprune.models.loading", "layerprune.tasks.data")
    assert not goes_up_or_sideways("layerprune.pipeline.stages", "layerprune.prune.api")
    assert not goes_up_or_sideways("layerprune.cli.prune", "layerprune.core.recipe_loading")
    assert not goes_up_or_sideways("layerprune.prune.api", "layerprune.prune.scores")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def test_no_pipeline_module_sits_in_an_import_cycle():
    """The study engine's modules are layered (cells < the kinds' grids < reports < runners): no two import each
    other, directly or round a circle, lazily or not."""
    graph: dict[str, set[str]] = {}
    for importer, _, target in arrows():
        if importer != target and importer.startswith("layerprune.pipeline") and target.startswith(
                "layerprune.pipeline"):
            graph.setdefault(importer, set()).add(target)
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check sees a circle


def test_no_module_in_pipeline_is_over_400_lines():
    """Issue 56's floor: a pipeline module past 400 lines holds two things; split it where they part."""
    long = {str(path.relative_to(SRC)): n for path in (SRC / "layerprune" / "pipeline").rglob("*.py")
            if (n := len(path.read_text().splitlines())) > 400}
    assert not long, long
