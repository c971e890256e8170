"""The layout docs/architecture.md describes, checked on the source: room sizes, one direction of imports, no
import cycle, and plain-torch parts that never import Lightning (directly or through another part)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "jagg_lightning"
# the parts that are plain torch: they can be read, tested and reused without Lightning
PLAIN = ["jagg", "sde", "grpo", "config", "rollout", "passes", "sampler", "update", "collectives", "metrics", "batching",
         "full_finetune", "reference", "export", "sharded_checkpoint"]
HIGHER = ("jagg_lightning.callbacks", "jagg_lightning.testbed", "jagg_lightning.cli")  # nothing in the core imports these


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Modules ``path`` imports (outside ``if TYPE_CHECKING:``); ``top_level_only``: not inside functions."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node, nested):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if not (top_level_only and inner):
                if isinstance(child, ast.Import):
                    found.update(a.name for a in child.names)
                elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                    found.add(child.module)
                    found.update(f"{child.module}.{a.name}" for a in child.names)
            visit(child, inner)

    visit(tree, False)
    return found


FILES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def package_imports(name: str, top_level_only: bool = False) -> set[str]:
    return {m for m in imports(FILES[name], top_level_only) if m in FILES and m != name}


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
    graph = {n: package_imports(n, top_level_only=True) - {"jagg_lightning"} for n in FILES}
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
        todo += [m for m in package_imports(name) if m != "jagg_lightning"]
    assert f"jagg_lightning.{part}" in seen
