"""Import rules (STYLE.md §3.2, ARCHITECTURE.md): the engine works without torch; algorithms
never touch shared memory or torch; only shmcoll/torch_backend imports torch."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shmcoll"
# shmcoll/__init__.py registers backend "shm" when torch is importable: a function-level
# `import torch.distributed` inside try/except ImportError (ARCHITECTURE.md: "register()
# ... done by `import shmcoll`"). Nothing else outside torch_backend may import torch.
GUARDED_TORCH_IMPORT_ALLOWED = {PACKAGE / "__init__.py"}

NO_TORCH_SCRIPT = """
import sys
sys.modules["torch"] = None  # any `import torch...` now raises ImportError
import numpy as np
import shmcoll, shmcoll.group, shmcoll.shm_group, shmcoll.algorithms
loaded = sorted(k for k in sys.modules if k == "torch" or k.startswith("torch."))
assert loaded == ["torch"] and sys.modules["torch"] is None, loaded
g = shmcoll.new_shm_group(shmcoll.FileStore(sys.argv[1]), 0, 1)
a = np.arange(4, dtype=np.float32)
g.all_reduce(a)
g.close()
print("ok")
"""


def _imports(path):
    """(module name, lineno, node) of every import in a file; relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT).with_suffix("")
    package = list(rel.parts[:-1])  # the package a relative import starts from
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, node
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x, y
                    for alias in node.names:
                        yield f"{mod}.{alias.name}", node.lineno, node
                    continue
            else:
                mod = node.module
            yield mod, node.lineno, node


def _top_level_torch_imports(path):
    """Imports of torch that run at import time (not inside a function)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            fn = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, fn) for a in child.names
                             if a.name.split(".")[0] == "torch")
            elif isinstance(child, ast.ImportFrom) and not child.level and \
                    (child.module or "").split(".")[0] == "torch":
                found.append((child.module, child.lineno, fn))
            visit(child, fn)

    visit(tree, False)
    return found


def _py_files(directory):
    return sorted(p for p in directory.rglob("*.py") if "__pycache__" not in p.parts)


def test_engine_imports_without_torch(tmp_path):
    proc = subprocess.run([sys.executable, "-c", NO_TORCH_SCRIPT, str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("path", _py_files(PACKAGE / "algorithms"),
                         ids=lambda p: p.name)
def test_algorithms_never_import_shm_group_or_torch(path):
    for module, lineno, _ in _imports(path):
        parts = module.split(".")
        assert parts[0] != "torch", f"{path.name}:{lineno} imports {module}"
        assert parts[0] != "threaded_pg", f"{path.name}:{lineno} imports {module}"
        if parts[0] == "shmcoll":
            assert parts[1:2] not in (["shm"], ["shm_group"], ["group"], ["torch_backend"],
                                      ["p2p"]), f"{path.name}:{lineno} imports {module}"
            assert module not in ("shmcoll",), f"{path.name}:{lineno} imports the package"


@pytest.mark.parametrize("path", [p for p in _py_files(PACKAGE)
                                  if (PACKAGE / "torch_backend") not in p.parents],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_torch_backend_imports_torch(path):
    for module, lineno, in_function in _top_level_torch_imports(path):
        allowed = path in GUARDED_TORCH_IMPORT_ALLOWED and in_function
        assert allowed, (f"shmcoll/{path.relative_to(PACKAGE)}:{lineno} imports {module} "
                         f"(only shmcoll/torch_backend may import torch)")
    for module, lineno, _ in _imports(path):
        assert not module.startswith("shmcoll.torch_backend") or \
            path in GUARDED_TORCH_IMPORT_ALLOWED, \
            f"shmcoll/{path.relative_to(PACKAGE)}:{lineno} imports {module}"


def test_resolver_sees_relative_imports():
    """Guard for the checks above: the AST walk resolves `from .. import x` forms."""
    mods = {m for m, _, _ in _imports(PACKAGE / "algorithms" / "__init__.py")}
    assert "shmcoll.single_copy" in mods and "shmcoll.algorithms.all_reduce" in mods, mods
