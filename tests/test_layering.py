"""Imports point one way (DESIGN.md): pallas_kernels < xla_cpu < model < sharding < serving < training < benchmarks < jaxseek
< scripts; inside `serving`, base < (structured, speculation, prefix) < core < api.

Every import counts, lazy ones inside functions and `importlib.import_module("...")` calls included, and no
files import each other in a circle."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("pallas_kernels", "xla_cpu", "model", "sharding", "serving", "training", "benchmarks", "jaxseek", "scripts")


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


@pytest.mark.parametrize("source, bad", [("from serving.core.engine import Engine\n", "serving.core.engine"),
                                          ("importlib.import_module('training.train')\n", "training.train")])
def test_the_check_sees_upward_imports(source, bad, tmp_path):
    (tmp_path / "m.py").write_text(source)
    assert bad in imported_modules(tmp_path / "m.py")


# serving's sub-packages, in order: each imports only the ones before it (those of one rank not each other), and
# none imports the short import paths kept at the top of `serving` (`serving.engine`, `serving.sampling`,
# `serving.router`)
SERVING = (("base",), ("structured", "speculation", "prefix"), ("core",), ("api",))
STEP_PROGRAMS = {"serving.core.step", "serving.core.layer_programs", "serving.core.engine_dp", "serving.core.placement",
                 "serving.core.executable_cache"}
KERNEL_FORMS = {"xla_cpu.moe", "xla_cpu.linear", "xla_cpu.fp4_experts"}


def serving_rank(module: str) -> tuple[int, str] | None:
    """(rank, sub-package) of a serving sub-package or a module of one (None: neither)."""
    parts = module.split(".")
    if parts[0] != "serving" or len(parts) < 2:
        return None
    return next(((i, parts[1]) for i, names in enumerate(SERVING) if parts[1] in names), None)


def inner_rule_breaks(graph: dict[str, set[str]]) -> list[str]:
    """Imports that break the rules inside packages: serving's sub-packages import down their order (`SERVING`)
    and never the short paths; the API front (`serving.api`) never imports the step programs or the kernel
    registry; in `serving` only the step programs import the registry; the operations' XLA:CPU forms are reached
    through the registry alone (benchmarks time them directly; `serving.core.layer_programs` may ask
    `xla_cpu.moe.viewed` whether a bucket takes expert views)."""
    breaks = []
    for module, deps in graph.items():
        for dep in deps:
            here, there = serving_rank(module), serving_rank(dep)
            if here is not None and dep.startswith("serving.") and there is None:
                breaks.append(f"{module} imports the short path {dep}")
            if here is not None and there is not None and here[1] != there[1] and here[0] <= there[0]:
                breaks.append(f"serving.{here[1]}'s {module} imports {dep}, not below it")
            if module.startswith("serving.api.") and (dep in STEP_PROGRAMS or dep == "model.registry"):
                breaks.append(f"the API front's {module} imports {dep}")
            if module.startswith("serving.") and dep == "model.registry" and module not in STEP_PROGRAMS:
                breaks.append(f"{module} imports the kernel registry outside the step programs")
            if dep in KERNEL_FORMS and module != "model.registry" and not module.startswith(("xla_cpu.", "benchmarks.")) and not (
                    module == "serving.core.layer_programs" and dep == "xla_cpu.moe"):
                breaks.append(f"{module} imports the XLA:CPU forms {dep} past the registry")
    return breaks


def test_rules_inside_packages():
    breaks = inner_rule_breaks(project_graph())
    assert not breaks, "imports breaking the rules inside packages:\n" + "\n".join(sorted(breaks))


def test_the_inner_rules_see_breaks():
    graph = {"serving.api.server": {"serving.core.step"}, "serving.core.scheduler": {"model.registry"},
             "model.moe": {"xla_cpu.moe"}, "serving.core.layer_programs": {"xla_cpu.moe", "model.registry"},
             "serving.base.request": {"serving.core.scheduler"}, "serving.prefix.prefix_cache": {
                 "serving.structured.constraints", "serving.base.request"}, "serving.api.batch": {"serving.engine"}}
    assert sorted(inner_rule_breaks(graph)) == [
        "model.moe imports the XLA:CPU forms xla_cpu.moe past the registry",
        "serving.api.batch imports the short path serving.engine",
        "serving.base's serving.base.request imports serving.core.scheduler, not below it",
        "serving.core.scheduler imports the kernel registry outside the step programs",
        "serving.prefix's serving.prefix.prefix_cache imports serving.structured.constraints, not below it",
        "the API front's serving.api.server imports serving.core.step"]


def test_the_short_import_paths_are_the_moved_modules():
    import subprocess
    import sys

    from serving.base.sampling import SamplingParams as moved_params
    from serving.core.engine import Engine as moved_engine
    from serving.engine import Engine
    from serving.sampling import SamplingParams

    assert Engine is moved_engine and SamplingParams is moved_params
    usage = subprocess.run([sys.executable, "-m", "serving.router", "--help"], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
    assert usage.returncode == 0 and "--replica" in usage.stdout
