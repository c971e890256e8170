"""The layout docs/architecture.md describes, checked on the source: room sizes, one direction of imports, no
import cycle (counting imports inside functions, and a module importing its own package), no function-level import
of the project's own modules in policies/, and plain-torch parts that never import Lightning (directly or through
another part)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "jagg_lightning"
# the parts that are plain torch: they can be read, tested and reused without Lightning
PLAIN = ["jagg", "routing", "objectives", "sde", "ode_solvers", "grpo", "config", "checks", "dtypes", "old_keys", "rollout", "passes",
         "sampler", "update", "collectives", "metrics", "batching", "full_finetune", "reference", "export", "sharded_checkpoint",
         "estimators", "adapters", "grids", "policy_checks", "policies", "memory_plan.plan", "memory_plan.advice",
         "memory_plan.models", "memory_plan.trace", "memory_plan.shapes", "memory_plan.table"]
HIGHER = ("jagg_lightning.callbacks", "jagg_lightning.testbed", "jagg_lightning.cli")  # nothing in the core imports these


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, functions_only: bool = False) -> set[str]:
    """Modules ``path`` imports, at any depth -- inside functions too -- but not under ``if TYPE_CHECKING:``
    (annotations only); ``functions_only``: just those inside functions. A relative import is resolved."""
    tree = ast.parse(path.read_text())
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()

    def visit(node, nested):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if inner or not functions_only:
                if isinstance(child, ast.Import):
                    found.update(a.name for a in child.names)
                elif isinstance(child, ast.ImportFrom):
                    base = package[: len(package) - (child.level - 1)] if child.level else []
                    module = ".".join(base + ([child.module] if child.module else []))
                    found.add(module)
                    found.update(f"{module}.{a.name}" for a in child.names)  # `from pkg import submodule`
            visit(child, inner)

    visit(tree, False)
    return found


FILES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def package_imports(name: str, functions_only: bool = False) -> set[str]:
    """The package's modules ``name`` imports (``pkg.mod.func`` counts as ``pkg.mod``); the package root re-exports
    (it is not a dependency), but a subpackage's ``__init__`` is one, its own submodules' included."""
    out = set()
    for module in imports(FILES[name], functions_only):
        while module and module not in FILES:
            module = module.rpartition(".")[0]
        if module and module not in (name, "jagg_lightning"):
            out.add(module)
    return out


def test_rooms_are_small():
    """No file in the package over 450 lines, no class over 300 (JAGGModule included)."""
    too_big = []
    for name, path in FILES.items():
        text = path.read_text()
        if len(text.splitlines()) > 450:
            too_big.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                too_big.append(f"class {node.name} in {name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_big, too_big
    assert "JAGGModule" in FILES["jagg_lightning.module"].read_text()  # the size check saw the module


def test_the_core_never_imports_callbacks_testbed_or_cli():
    core = [n for n in FILES if not n.startswith(HIGHER) and n != "jagg_lightning.__main__"]
    wrong = {n: sorted(m for m in imports(FILES[n]) if m.startswith(HIGHER)) for n in core}
    assert len(core) > 20 and not {n: m for n, m in wrong.items() if m}


def test_no_import_cycle():
    """Counting the imports inside functions: a lazy import hides a cycle from Python, not from the reader."""
    graph = {n: package_imports(n) for n in FILES}
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def walk(node, path):
        if state.get(node) == 1:
            pytest.fail("import cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if state.get(node) == 2:
            return
        state[node] = 1
        for nxt in sorted(graph[node]):
            walk(nxt, path + [node])
        state[node] = 2

    for n in sorted(graph):
        walk(n, [])
    assert len(state) == len(FILES)


def test_the_cycle_check_sees_a_lazy_import(tmp_path, monkeypatch):
    """The graph counts an import inside a function, and a module importing its own package's ``__init__``."""
    pkg = tmp_path / "jagg_lightning" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from jagg_lightning.sub.leaf import f\n")
    (pkg / "leaf.py").write_text("def f():\n    from jagg_lightning.sub import g\n    return g\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "jagg_lightning")
    files = {module_name(p): p for p in (tmp_path / "jagg_lightning").rglob("*.py")}
    monkeypatch.setattr(__import__(__name__), "FILES", files)
    assert package_imports("jagg_lightning.sub.leaf") == {"jagg_lightning.sub"}
    assert package_imports("jagg_lightning.sub") == {"jagg_lightning.sub.leaf"}


def test_policies_import_nothing_of_ours_inside_functions():
    """The family interface takes what it needs at the top of each file: no hidden dependency."""
    lazy = {n: sorted(package_imports(n, functions_only=True)) for n in FILES if n.startswith("jagg_lightning.policies")}
    assert not {n: m for n, m in lazy.items() if m}


@pytest.mark.parametrize("part", PLAIN)
def test_plain_parts_do_not_import_lightning(part):
    """Nor does any part they import (the package's __init__ aside: importing a part runs it, by Python's rules)."""
    seen, todo = set(), [f"jagg_lightning.{part}"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        assert not any(m == "lightning" or m.startswith(("lightning.", "pytorch_lightning")) for m in imports(FILES[name])), name
        todo += sorted(package_imports(name))
    assert f"jagg_lightning.{part}" in seen
