"""The layer picture of docs/architecture.md holds: imports point down only."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "specserve"
# package → the packages it must never import (the layers above it)
ABOVE = {
    "models": {"cache", "runtime", "parallel", "drafters", "spec", "engine", "server", "train", "bench"},
    "cache": {"runtime", "parallel", "drafters", "spec", "engine", "server", "train", "bench"},
    "runtime": {"parallel", "drafters", "spec", "engine", "server", "train", "bench"},
    "parallel": {"drafters", "spec", "engine", "server", "train", "bench"},
    "drafters": {"spec", "engine", "server", "bench"},
    "spec": {"engine", "server", "bench"},
    "engine": {"server", "bench"},
}


def _imported_packages(path: Path) -> set[str]:
    """Top-level specserve sub-packages a module imports (absolute or relative, at any depth). Imports under
    `if TYPE_CHECKING:` are annotations only, no runtime arrow: skipped."""
    rel = path.relative_to(PKG).parts
    out: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
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


def test_checker_sees_relative_imports() -> None:
    src = PKG / "runtime" / "runner.py"
    assert {"cache", "models"} <= _imported_packages(src)
