"""The import graph of colocate/ follows docs/architecture.md: no cycles, and dependencies point down.

The graph is read from the source with ast: every `import` and `from ... import` of a colocate
module, at module level or inside a function, is an edge to the module it names (`from pkg import
name` to pkg.name when that is a module, else to pkg). Imports under `if TYPE_CHECKING:` never
run and only name types for annotations, so they are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "colocate"

FORBIDDEN = {  # modules under the key: what they must not import
    "colocate.kernels": ("colocate.models", "colocate.trainer", "colocate.rollout", "colocate.colocation"),
    "colocate.models": ("colocate.trainer", "colocate.rollout", "colocate.colocation"),
    "colocate.trainer": ("colocate.colocation", "colocate.train"),
    "colocate.rollout": ("colocate.colocation", "colocate.train", "colocate.envs"),
    "colocate.envs": ("colocate.trainer", "colocate.colocation", "colocate.train", "colocate.models"),
    "colocate.lora": ("colocate.trainer", "colocate.rollout", "colocate.colocation", "colocate.checkpoint", "colocate.export"),
    "colocate.checkpoint": ("colocate.trainer",),
    "colocate.export": ("colocate.trainer",),
}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, whether it is a package's __init__)."""
    modules = {}
    for file in PACKAGE.rglob("*.py"):
        parts = list(file.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (file, is_package)
    return modules


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` outside `if TYPE_CHECKING:` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """Each colocate module -> the colocate modules it imports."""
    modules = _modules()

    def known(name: str) -> str | None:  # the module itself, else the nearest package holding it
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (file, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        targets = []
        for node in _runtime_nodes(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                    base = f"{anchor}.{base}" if base else anchor
                targets += [f"{base}.{alias.name}" for alias in node.names]
        graph[name] = {known(t) for t in targets if t.split(".")[0] == "colocate"} - {None, name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "colocate.kernels.flash" in graph["colocate.kernels.invariant_ops"]  # module level
    assert "colocate.kernels.batch_invariant_cuda" in graph["colocate.kernels.batch_invariant"]  # in a function
    assert "colocate.lora.identity" in graph["colocate.checkpoint"]  # from a subpackage's module
    assert "colocate.config" not in graph["colocate.config_checks"]  # under TYPE_CHECKING only


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_dependencies_point_down():
    graph = import_graph()
    upward = [
        (module, target)
        for layer, banned in FORBIDDEN.items()
        for module in sorted(graph)
        if _under(module, layer)
        for target in sorted(graph[module])
        if any(_under(target, b) for b in banned)
    ]
    assert upward == []
