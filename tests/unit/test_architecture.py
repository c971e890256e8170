"""The layout docs/architecture.md describes, checked on the source: every module in its folder, one direction of
imports between the folders, room sizes, no import cycle (counting imports inside functions, and a module importing
its own package), no function-level import of the project's own modules in policies/, and plain-torch parts that
never import Lightning (directly, through another part, or through their folder's ``__init__``)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "jagg_lightning"
# the modules at the top of the package: what a user hands the Trainer, and the public re-export kept for configs
TOP = {"jagg_lightning", "jagg_lightning.__main__", "jagg_lightning.module", "jagg_lightning.data",
       "jagg_lightning.strategies"}
REEXPORTS = {"jagg_lightning.strategies"}  # public paths kept for configs: nothing inside the package imports them
# folder -> the folders it may import (besides itself and the leaves of utils/); the direction is this table's,
# acyclic (test_the_folder_order_is_a_direction); "top" is module.py and data.py
UNDER = {
    "utils": set(),
    "faults": set(),
    "method": set(),
    "models": {"faults"},
    "config": {"method", "models"},
    "policies": {"models", "config"},
    "rewards": {"models"},
    "distributed": {"faults", "models"},
    "training": {"faults", "method", "models", "config", "policies", "rewards", "distributed"},
    "objectives": {"faults", "method", "models", "config", "policies", "rewards", "distributed", "training"},
    "memory_plan": {"faults", "method", "models", "config", "policies", "rewards", "distributed", "training"},
    "top": {"faults", "method", "models", "config", "policies", "rewards", "distributed", "training", "objectives"},
    "testbed": {"faults", "method", "models", "config", "policies", "rewards", "distributed", "training",
                "objectives", "top"},
    "callbacks": {"faults", "method", "models", "config", "policies", "rewards", "distributed", "training",
                  "objectives", "memory_plan", "top", "testbed"},  # memory_plan: PeakMemory's plan
    "cli": {"faults", "method", "models", "config", "policies", "rewards", "distributed", "training", "objectives",
            "memory_plan", "top", "testbed", "callbacks"},
}
# the modules that use Lightning; every other module is plain torch and never imports it, even indirectly
LIGHTNING = ("jagg_lightning.module", "jagg_lightning.data", "jagg_lightning.callbacks", "jagg_lightning.cli",
             "jagg_lightning.__main__", "jagg_lightning.strategies", "jagg_lightning.distributed.strategies",
             "jagg_lightning.training.images", "jagg_lightning.training.state", "jagg_lightning.testbed.evaluate")


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


def folder(name: str) -> str:
    """The folder a module is in: ``jagg_lightning.method.jagg`` -> ``method``; module.py and data.py: ``top``."""
    parts = name.split(".")
    if name in ("jagg_lightning.module", "jagg_lightning.data"):
        return "top"
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and FILES[name].name == "__init__.py") else name


def wrong_direction(graph: dict[str, set[str]]) -> list[str]:
    """The imports of ``graph`` (module -> the package's modules it imports) that go against :data:`UNDER`."""
    wrong = []
    for name, targets in sorted(graph.items()):
        if name in TOP - {"jagg_lightning.module", "jagg_lightning.data"}:
            continue  # the package root, __main__ (-> cli) and the re-exports: checked by their own tests
        here = folder(name)
        for target in sorted(targets):
            there = folder(target)
            if target in REEXPORTS:
                wrong.append(f"{name} imports the re-export {target} (import its new place)")
            elif there != here and there != "utils" and there not in UNDER[here]:
                wrong.append(f"{name} ({here}/) imports {target} ({there}/)")
    return wrong


def test_every_module_is_in_a_folder():
    """A new module goes in the folder of its concern (docs/architecture.md); the top holds only what a user hands
    the Trainer (module.py, data.py), the entry points and the kept re-exports."""
    loose = sorted(n for n in FILES if n.count(".") == 1 and FILES[n].name != "__init__.py" and n not in TOP)
    assert not loose, f"put these in a folder: {loose}"
    assert {folder(n) for n in FILES if n not in TOP} | {"top"} == set(UNDER), "a folder UNDER does not list"


def test_imports_go_one_way_between_folders():
    """Counting imports inside functions: the method imports nothing of the training step, models/ nothing of
    policies/, the core never imports callbacks/, testbed/ or cli/ (the CLI: imported by ``__main__`` alone), ..."""
    graph = {n: package_imports(n) for n in FILES}
    assert not wrong_direction(graph)
    assert package_imports("jagg_lightning.__main__") == {"jagg_lightning.cli"}
    assert package_imports("jagg_lightning.strategies") == {"jagg_lightning.distributed.strategies"}
    assert "jagg_lightning.method.jagg" in graph["jagg_lightning.training.update"]  # the graph saw the imports


def test_the_direction_check_sees_a_wrong_import():
    """A method module importing the training step, a model importing a family, the step importing the CLI and a
    package module importing a re-export are each reported; the package as it is gives nothing to report."""
    wrong = wrong_direction({"jagg_lightning.method.jagg": {"jagg_lightning.training.update"},
                             "jagg_lightning.models.adapters": {"jagg_lightning.policies.base"},
                             "jagg_lightning.training.sampler": {"jagg_lightning.cli.plan", "jagg_lightning.utils.checks"},
                             "jagg_lightning.training.update": {"jagg_lightning.strategies"}})
    assert len(wrong) == 4 and all("utils" not in w for w in wrong), wrong


def test_the_folder_order_is_a_direction():
    """:data:`UNDER` has no cycle: two folders never may import each other, even through a third."""
    state: dict[str, int] = {}

    def walk(node, path):
        assert state.get(node) != 1, "folder cycle: " + " -> ".join(path + [node])
        if state.get(node) != 2:
            state[node] = 1
            for nxt in sorted(UNDER[node]):
                walk(nxt, path + [node])
            state[node] = 2

    for node in UNDER:
        walk(node, [])


def test_folders_say_what_lives_there():
    """Each folder's ``__init__`` has a docstring naming what it may import; the new folders' ``__init__`` import
    nothing, so importing a plain part runs no more than that part."""
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc, f"{init.parent.name}/__init__.py: say what lives there and what it may import"
    for name in ("method", "training", "models", "distributed", "faults", "utils"):
        assert not imports(PACKAGE / name / "__init__.py"), name


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


@pytest.mark.parametrize("part", sorted(n for n in FILES if not n.startswith(LIGHTNING) and n != "jagg_lightning"))
def test_plain_parts_do_not_import_lightning(part):
    """Nor does any part they import, nor their folder's ``__init__`` (which Python runs first); the package root
    aside (its names are imported on first use)."""
    seen, todo = set(), [part]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        assert not any(m == "lightning" or m.startswith(("lightning.", "pytorch_lightning")) for m in imports(FILES[name])), name
        parent = name.rpartition(".")[0]
        todo += sorted(package_imports(name)) + ([parent] if parent in FILES and parent != "jagg_lightning" else [])
    assert part in seen
