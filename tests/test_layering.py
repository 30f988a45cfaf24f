"""Imports point one way (DESIGN.md): pallas_kernels < model < sharding < serving < training < benchmarks < jaxseek
< scripts.

Every import counts, lazy ones inside functions and `importlib.import_module("...")` calls included, and no
files import each other in a circle."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("pallas_kernels", "model", "sharding", "serving", "training", "benchmarks", "jaxseek", "scripts")


def imported_modules(path: pathlib.Path) -> list[str]:
    """Absolute module names `path` imports anywhere in its body."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.append(node.args[0].value)
    return names


def project_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    files = {".".join(f.relative_to(ROOT).with_suffix("").parts): f for layer in LAYERS
             for f in (ROOT / layer).rglob("*.py")}
    return {module: {name.removesuffix(".__init__") for name in imported_modules(path)
                     if name in files or f"{name}.__init__" in files}
            for module, path in files.items()}


def test_imports_point_down():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = [f"{module} imports {dep}" for module, deps in project_graph().items() for dep in deps
              if rank[dep.split(".")[0]] > rank[module.split(".")[0]]]
    assert not upward, "imports pointing up a layer:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    graph, state, cycles = project_graph(), {}, []

    def visit(module, stack):
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "files importing each other in a circle:\n" + "\n".join(cycles)


@pytest.mark.parametrize("source, bad", [("from serving.engine import Engine\n", "serving.engine"),
                                          ("importlib.import_module('training.train')\n", "training.train")])
def test_the_check_sees_upward_imports(source, bad, tmp_path):
    (tmp_path / "m.py").write_text(source)
    assert bad in imported_modules(tmp_path / "m.py")
