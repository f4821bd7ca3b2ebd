"""The house rules of art/, checked from the source alone (no imports, no models): imports point
one way along the layers below and never form a cycle, every module says on its first line what
it is for, and no module grows past 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600

# Lower layers first. A module may import from its own layer or a lower one, never a higher one.
# The first prefix that matches a module names its layer (longest prefixes are listed first
# inside a layer where they overlap).
LAYERS: tuple[tuple[str, ...], ...] = (
    # configuration and model building: settings, provider, specs, weights, LoRA, runtimes
    ("art.megatron", "art"),
    # public value types and what one micro-batch asks for
    ("art.trainer_rank._types", "art.trainer_rank._request"),
    # collectives and the per-phase protocol that keep ranks in step
    ("art.trainer_rank.ranks",),
    # items, packing, decoder forward, heads, one micro-batch executed
    ("art.trainer_rank.compute",),
    # pricing: the memory model's terms, from geometry, layout, recompute and the packed tokens
    ("art.trainer_rank.pricing",),
    # measuring: the meter, the device limit, the probe (which runs the compute path)
    ("art.trainer_rank.measuring",),
    # admission, profiles, escalation, runnable layouts
    ("art.trainer_rank.decide",),
    # adapter checkpoint slots (each with its own Adam state)
    ("art.trainer_rank.slots",),
    # the optimizer step and the live graphs it may refuse to run under
    ("art.trainer_rank.optimizer",),
    # the trainer's knobs and the orchestrator
    ("art.trainer_rank._options", "art.trainer_rank._impl", "art.trainer_rank._micro_batch_run"),
    # the public API and the command line
    ("art.trainer_rank.cli", "art.trainer_rank.__main__", "art.trainer_rank"),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT / "art") -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(root.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module of ours `name` refers to: itself, or the closest enclosing module we have."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of ours that `module` imports, at the top or inside a function."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import submodule` imports the submodule, `from mod import name` the module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, known)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


def layer_of(module: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for layer, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), layer)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_house.py: add it to LAYERS")
    return best[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
                  for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def _graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports_of(m, p, known) for m, p in known.items()}


def test_no_import_cycle() -> None:
    cycle = find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imports_point_down_the_layers() -> None:
    upward = upward_imports(_graph())
    assert not upward, ("imports from a higher layer into a lower one (layers in "
                        "tests/test_house.py):\n" + "\n".join(upward))


def test_every_module_says_what_it_is_for() -> None:
    missing = [str(p.relative_to(ROOT)) for p in modules().values()
               if not p.read_text().startswith('"""')
               or ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not missing, "modules whose first line is not their docstring: " + ", ".join(missing)


def test_no_module_over_600_lines() -> None:
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): " + ", ".join(long)


def test_the_checks_see_a_violation() -> None:
    """The graph checks themselves: a made-up upward import and a made-up cycle are found."""
    graph = {"art.trainer_rank.pricing.model": {"art.trainer_rank.decide.admission"},
             "art.trainer_rank.decide.admission": {"art.trainer_rank._types"}}
    assert upward_imports(graph) == [
        "art.trainer_rank.pricing.model (layer 4) imports art.trainer_rank.decide.admission "
        "(layer 6)"]
    graph["art.trainer_rank._types"] = {"art.trainer_rank.pricing.model"}
    assert find_cycle(graph) is not None
