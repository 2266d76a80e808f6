"""The library's structure holds: no import circle among its modules, and no module reads a private
name (``obj._x``) that another of our modules defines; reads of a framework's private names (the
APIs the adapters patch) are not ours to change and are not counted."""

from __future__ import annotations

import ast
import pathlib

import flashckpt_integrations

PACKAGE = pathlib.Path(flashckpt_integrations.__file__).parent
FRAMEWORKS = {
    ("flashckpt_integrations.core.state", "_size"): "torch's TypedStorage",
    ("flashckpt_integrations.launcher.node_failure", "_op_executor"): "torch elastic's rendezvous handler",
}
"""Reads of a framework's private names that share a name with one of ours."""


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = (path, ast.parse(path.read_text()))
    return found


def _imports(name: str, path: pathlib.Path, tree: ast.Module, modules: dict) -> set[str]:
    """The modules of ours that ``name`` imports anywhere (inside functions and TYPE_CHECKING too)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                out.add(full if full in modules else target)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in modules and m != name}


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, tree, modules) for name, (path, tree) in modules.items()}
    packages = {name for name, (path, _) in modules.items() if path.name == "__init__.py"}
    done: set[str] = set()

    def visit(name: str, trail: tuple[str, ...]) -> None:
        assert name not in trail, f"import circle: {' -> '.join((*trail[trail.index(name):], name))}"
        if name in done:
            return
        for dep in graph[name]:
            if dep in packages and name.startswith(dep + "."):
                continue  # a module's own package, which names it (its face re-exports it)
            visit(dep, (*trail, name))
        done.add(name)

    for name in graph:
        visit(name, ())


def test_no_module_reads_another_modules_private_names():
    modules = _modules()
    defined: dict[str, set[str]] = {}
    for name, (_, tree) in modules.items():
        for node in ast.walk(tree):
            private = None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                private = node.name
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                private = node.attr
            if private and private.startswith("_") and not private.startswith("__"):
                defined.setdefault(private, set()).add(name)
    reads = []
    for name, (_, tree) in modules.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in defined and name not in defined[node.attr]):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls", "torch", "threading"):
                continue
            if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
                continue  # a subclass of a framework's class calls the method it overrides
            if (name, node.attr) in FRAMEWORKS:
                continue
            reads.append(f"{name}:{node.lineno} {ast.unparse(node)} (defined in {sorted(defined[node.attr])})")
    assert not reads, "private names read from another module:\n" + "\n".join(reads)
