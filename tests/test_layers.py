"""The shape of the code: layers import only downward, and the code inside interpreters
imports none of the host's modules (docs/design.md, "Layers")."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "multipy"

#: Bottom-up: each module may import only modules before it.
LAYERS = ["errors", "_launch", "_host", "_bootstrap", "_glibc", "_protocol", "_sharing", "_runtime",
          "_pool", "session", "environment", "replicated", "package", "manager", "cli",
          "__main__", "__init__"]
#: What the code inside interpreters may import of multipy.
INSIDE_MAY_IMPORT = {"_protocol", "_sharing", "_inside"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, first component of the multipy module) of each import that runs (not the
    ones under ``if TYPE_CHECKING:``), relative or absolute."""
    tree = ast.parse(path.read_text())
    skipped = {id(node) for block in ast.walk(tree)
               if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
               for child in block.body for node in ast.walk(child)}
    found = []
    depth = len(path.relative_to(PACKAGE).parts) - 1  # 1 inside _inside/
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = (node.module or "").split(".") if node.module else []
                if node.level - 1 > depth:
                    continue
                base = ["_inside"] if depth == 1 and node.level == 1 else []
                names = [base + parts] if parts else [base + [a.name] for a in node.names]
                for name in names:
                    found.append((node.lineno, name[0] if name else ""))
            elif node.module and node.module.split(".")[0] == "multipy":
                rest = node.module.split(".")[1:] or [a.name for a in node.names]
                found.append((node.lineno, rest[0]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "multipy" and len(parts) > 1:
                    found.append((node.lineno, parts[1]))
    return found


def test_layers_import_only_downward():
    upward = []
    for name in LAYERS:
        path = PACKAGE / f"{name}.py"
        if not path.exists():
            continue
        for line, target in _imports(path):
            if target not in LAYERS[:LAYERS.index(name)]:
                upward.append(f"{name}.py:{line} imports {target}")
    assert not upward, upward
    listed = {p.stem for p in PACKAGE.glob("*.py")}
    assert listed <= set(LAYERS), f"modules without a layer: {listed - set(LAYERS)}"


def test_inside_code_imports_no_host_module():
    wrong = [f"{path.name}:{line} imports {target}"
             for path in (PACKAGE / "_inside").glob("*.py")
             for line, target in _imports(path) if target not in INSIDE_MAY_IMPORT]
    assert not wrong, wrong
    for path in PACKAGE.glob("*.py"):
        assert all(target != "_inside" for _, target in _imports(path)), path.name


def test_an_interpreter_holds_none_of_the_host_api(manager):
    with manager.acquire_one() as s:
        modules = s.global_("builtins", "list")(s.global_("sys", "modules")).deref()
    names = sorted(n for n in modules if n == "multipy" or n.startswith("multipy."))
    assert {"multipy", "multipy._inside", "multipy._protocol", "multipy._sharing"} <= set(names)
    assert set(names) <= {"multipy", "multipy._inside", "multipy._inside.package",
                          "multipy._protocol", "multipy._sharing"}, names
