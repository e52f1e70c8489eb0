"""No import cycle among the library's files (docs/design.md §2): megatron_sp/, models/ and data/
(installed as megatron_sp.models and megatron_sp.data), read with ast, nothing imported.

An edge A -> B is any import statement in A naming B, at module level or inside a function
(`import a.b`, `from a.b import c`, relative forms; `from a import b` is an edge to the submodule
b when there is one, else to the package a). A cycle is a strongly connected component of more
than one file; the test names each one.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDERS = {"megatron_sp": "megatron_sp", "megatron_sp.models": "models", "megatron_sp.data": "data"}


def library_files(root: str = ROOT) -> dict[str, str]:
    """{module name: path} of every .py file of the library (a package is its __init__.py)."""
    found = {}
    for name, folder in FOLDERS.items():
        base = os.path.join(root, folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for filename in filenames:
                if not filename.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(dirpath, filename), base)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join([name, *parts])] = os.path.join(dirpath, filename)
    return found


def imports(module: str, path: str, known) -> tuple[set[str], set[str]]:
    """(module-level, function-level) library modules that `module`'s file imports."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    top, inner = set(), set()

    def targets(node) -> set[str]:
        if isinstance(node, ast.Import):
            return {a.name for a in node.names if a.name in known}
        base = node.module or ""
        if node.level:
            parent = package[:len(package) - node.level + 1]
            base = ".".join(parent + ([base] if base else []))
        found = set()
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in known:
                found.add(sub)
            elif base in known:
                found.add(base)
        return found

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                       ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (inner if inside else top).update(targets(child) - {module})
            visit(child, inside)
    visit(tree, False)
    return top, inner


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def import_graph(root: str = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module-level edges, all edges) of the library."""
    files = library_files(root)
    top, every = {}, {}
    for module, path in files.items():
        t, f = imports(module, path, files)
        top[module], every[module] = t, t | f
    return top, every


def test_the_graph_sees_the_imports():
    """The graph code finds known edges of each kind (so an empty cycle list means something)."""
    top, every = import_graph()
    assert len(top) > 100
    assert "megatron_sp.errors" in top["megatron_sp.mesh"]                       # module level
    assert "megatron_sp.models.gpt" in top["megatron_sp.models"]                  # package
    pretrained = "megatron_sp.checkpointing.pretrained"           # load_pretrained: in a function
    assert "megatron_sp.models" in every[pretrained] and "megatron_sp.models" not in top[pretrained]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_the_library_files():
    top, every = import_graph()
    assert cycles(top) == [], "module-level import cycles: " + "; ".join(
        " <-> ".join(c) for c in cycles(top))
    assert cycles(every) == [], "import cycles (function-level imports included): " + "; ".join(
        " <-> ".join(c) for c in cycles(every))


def test_errors_imports_nothing_of_ours():
    """errors.py holds the exception types only; every module may import it."""
    _, every = import_graph()
    assert every["megatron_sp.errors"] == set()
