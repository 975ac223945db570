"""The layer picture of docs/architecture.md holds: imports point down only."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "specserve"
# package → the packages it must never import (the layers above it), bottom up
_LAYERS = ["tokenizer", "formats", "models", "loading", "cache", "runtime", "parallel", "drafters", "cost",
           "speculative", "engine", "server", "train", "bench"]
ABOVE = {pkg: set(_LAYERS[i + 1:]) for i, pkg in enumerate(_LAYERS[:-3])}


def _imported_packages(path: Path, all_imports: bool = False) -> set[str]:
    """Top-level specserve sub-packages (or top-level modules: config, core, ...) a module imports (absolute or
    relative, at any depth). Imports under `if TYPE_CHECKING:` are annotations only, no runtime arrow: skipped
    unless `all_imports`."""
    rel = path.relative_to(PKG).parts
    out: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)} if not all_imports else set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] == "specserve" and len(parts) > 1:
                    out.add(parts[1])
            else:
                base = list(rel[:-1])[: len(rel) - node.level]
                parts = base + (node.module.split(".") if node.module else [])
                if parts:
                    out.add(parts[0])
                else:  # `from .. import x`: x is the sub-package
                    out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "specserve" and len(parts) > 1:
                    out.add(parts[1])
    return out


def test_imports_point_down() -> None:
    bad = []
    for pkg, above in ABOVE.items():
        for path in sorted((PKG / pkg).rglob("*.py")):
            hit = _imported_packages(path) & above
            if hit:
                bad.append(f"{path.relative_to(PKG)} imports {sorted(hit)}")
    assert not bad, "\n".join(bad)


def test_config_is_plain_data() -> None:
    """config.py is the ground floor: every layer reads it, and it reads none of them."""
    assert _imported_packages(PKG / "config.py", all_imports=True) == set()


def test_no_circle_between_packages() -> None:
    """Every import counts here, lazy and annotation-only ones too: no two packages reach each other."""
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).parts
        src = rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")
        graph.setdefault(src, set()).update(_imported_packages(path, all_imports=True) - {src})

    def reach(a: str) -> set[str]:
        seen, todo = set(), [a]
        while todo:
            for b in graph.get(todo.pop(), ()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    circles = sorted(a for a in graph if a in reach(a) and a != "__init__")
    assert not circles, f"packages on an import circle: {circles}"


def test_checker_sees_relative_imports() -> None:
    src = PKG / "runtime" / "runner.py"
    assert {"cache", "models"} <= _imported_packages(src)
