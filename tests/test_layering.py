"""Import rules (STYLE.md §00 and §3.2, ARCHITECTURE.md): the package tree shows the layers
(a folder per layer) and imports only go down them; no import circles, lazy ones included
(function-level imports and importlib.import_module("...") count); no `_private` name
imported from another package; the engine works without torch and only
shmcoll/torch_backend imports torch; `import shmcoll` / `import threaded_pg` (and the
`torch.backends` entry points, which `import torch` runs) import neither torch nor numba;
one writer per piece of state: no class is built from *Mixin bases (but the adapter's
method tables, which hold no state) and no attribute is assigned from two files (STYLE.md
§00, issue 24). No allow-lists."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shmcoll"
PACKAGES = ("shmcoll", "threaded_pg", "cuda_ipc")
# The layers, bottom up (ARCHITECTURE.md draws them). A module's layer is where it lives:
# shmcoll/<folder>/ is that folder's layer, shmcoll/<module>.py the vocabulary (errors,
# config, lazy_names), threaded_pg/ and cuda_ipc/ their own; but FRONT. A module imports
# its own layer and the layers below it, never one above. Packages on one line are one
# layer: algorithms and p2p both sit on the protocol and neither imports the other;
# cuda_ipc is the adapter's device half (its ProcessGroup methods for CUDA tensors are
# built on the adapter's checks, conversions and Work; the adapter hands CUDA tensors to it).
LAYERS = (
    ("shmcoll",),                    # vocabulary: shmcoll/errors.py, config.py, lazy_names.py
    ("shmcoll/native",),             # numba, the machine: jit, atomics, reducers, ops, ...
    ("shmcoll/protocol",),           # the rules (its docstring), layout, kernels, the Arena
    ("shmcoll/algorithms", "shmcoll/p2p"),
    ("shmcoll/engine",),             # Group
    ("shmcoll/shm",),                # segments, FileStore, new_shm_group
    ("shmcoll/hier",),               # several nodes
    ("shmcoll/tools",),              # the doctor, the kernel build
    ("shmcoll/torch_backend", "cuda_ipc"),
    ("front",),                      # FRONT
    ("threaded_pg",),                # the same engine with ranks as threads, backend "threaded"
)
# The package's face, above everything it names: shmcoll/__init__.py (the public names,
# loaded on first use, and backend "shm"'s registration) and the command `python -m
# shmcoll.doctor` (its module only runs tools/doctor.py).
FRONT = {"shmcoll", "shmcoll.doctor"}
RANK = {layer: i for i, layers in enumerate(LAYERS) for layer in layers}
# What `import shmcoll`, `import threaded_pg` and the entry points (pyproject.toml,
# `torch.backends`: run by every `import torch`) execute: at import time these modules
# import only the standard library and each other. Their names load the rest on first use.
IMPORT_TIME_MODULES = {
    "shmcoll": PACKAGE / "__init__.py",
    "shmcoll.lazy_names": PACKAGE / "lazy_names.py",
    "shmcoll.torch_backend": PACKAGE / "torch_backend" / "__init__.py",
    "shmcoll.torch_backend.plugin": PACKAGE / "torch_backend" / "plugin.py",
    "shmcoll.torch_backend.import_hook": PACKAGE / "torch_backend" / "import_hook.py",
    "threaded_pg": ROOT / "threaded_pg" / "__init__.py",
    "threaded_pg.plugin": ROOT / "threaded_pg" / "plugin.py",
}

LIGHT_IMPORT_SCRIPT = """
import sys
import {module}
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numba", "numpy"))
assert not heavy, heavy
print("ok")
"""

NO_TORCH_SCRIPT = """
import sys
sys.modules["torch"] = None  # any `import torch...` now raises ImportError
import numpy as np
import shmcoll, shmcoll.engine.group, shmcoll.shm.factory, shmcoll.algorithms
loaded = sorted(k for k in sys.modules if k == "torch" or k.startswith("torch."))
assert loaded == ["torch"] and sys.modules["torch"] is None, loaded
g = shmcoll.new_shm_group(shmcoll.FileStore(sys.argv[1]), 0, 1)
a = np.arange(4, dtype=np.float32)
g.all_reduce(a)
g.close()
print("ok")
"""


def _imports(path, tree=None):
    """(module name, lineno, node) of every import in a file (its parsed `tree` when given,
    so the nodes are that tree's); relative ones resolved."""
    tree = tree or ast.parse(path.read_text(), str(path))
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
        elif _is_import_module_call(node):  # importlib.import_module("a.b"): an edge too
            yield node.args[0].value, node.lineno, node


def _is_import_module_call(node):
    """A call importlib.import_module / import_module / __import__ with a literal name."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return False
    fn = node.func
    name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
    return name in ("import_module", "__import__")


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


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _files():
    """{module name: path} over PACKAGES."""
    return {_module_name(p): p for d in PACKAGES for p in _py_files(ROOT / d)}


def _import_graph():
    """{module: modules it imports, at any depth of the file (function-level included)} over
    shmcoll, threaded_pg and cuda_ipc. `from pkg import name` counts as importing pkg.name
    where that is a module, else pkg; a package __init__'s lazy names (a module-level dict
    of name -> submodule, read by its __getattr__) count as imports of those submodules."""
    files = _files()
    graph = {}
    for name, path in files.items():
        targets = set()
        for module, _, node in _imports(path):
            if isinstance(node, ast.ImportFrom):
                found = [f"{module}.{a.name}" for a in node.names
                         if f"{module}.{a.name}" in files]
                targets.update(found or [module])
            else:
                targets.add(module)
        if path.name == "__init__.py":
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                    targets.update(f"{name}.{v.value}" for v in node.value.values
                                   if isinstance(v, ast.Constant))
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def _circles(graph):
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_engine_imports_without_torch(tmp_path):
    """(A cold kernel cache compiles here, behind other processes' compiles: the timeout
    leaves room for that; a failure shows all the script said.)"""
    proc = subprocess.run([sys.executable, "-c", NO_TORCH_SCRIPT, str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", \
        f"exit {proc.returncode}\nstdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-4000:]}"


@pytest.mark.parametrize("path", _py_files(PACKAGE / "algorithms"),
                         ids=lambda p: p.name)
def test_algorithms_never_import_shm_group_or_torch(path):
    for module, lineno, _ in _imports(path):
        parts = module.split(".")
        assert parts[0] != "torch", f"{path.name}:{lineno} imports {module}"
        assert parts[0] != "threaded_pg", f"{path.name}:{lineno} imports {module}"
        if parts[0] == "shmcoll":
            assert parts[1:2] not in (["shm"], ["engine"], ["torch_backend"], ["p2p"],
                                      ["hier"]), f"{path.name}:{lineno} imports {module}"
            assert module not in ("shmcoll",), f"{path.name}:{lineno} imports the package"


@pytest.mark.parametrize("path", [p for p in _py_files(PACKAGE)
                                  if (PACKAGE / "torch_backend") not in p.parents],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_torch_backend_imports_torch(path):
    """(Nothing below the adapter imports it: test_imports_only_go_down.)"""
    for module, lineno, _ in _top_level_torch_imports(path):
        raise AssertionError(f"shmcoll/{path.relative_to(PACKAGE)}:{lineno} imports {module} "
                             f"(only shmcoll/torch_backend may import torch)")


@pytest.mark.parametrize("name", sorted(IMPORT_TIME_MODULES))
def test_import_time_modules_import_only_the_standard_library(name):
    """Statically: what runs at `import shmcoll` / `import threaded_pg` / `import torch`
    (the entry points) imports, outside functions, the standard library and the modules of
    IMPORT_TIME_MODULES only (the subprocess checks below run what is installed)."""
    if not hasattr(sys, "stdlib_module_names"):
        pytest.skip("Python < 3.10 has no sys.stdlib_module_names (the subprocess check runs)")
    path = IMPORT_TIME_MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    in_function = {id(n) for f in ast.walk(tree)
                   if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    for module, lineno, node in _imports(path, tree):
        if id(node) in in_function:
            continue
        ok = module.split(".")[0] in sys.stdlib_module_names or module in IMPORT_TIME_MODULES
        assert ok, f"{path.relative_to(ROOT)}:{lineno} imports {module} at import time"


@pytest.mark.parametrize("module", ["shmcoll", "threaded_pg", "shmcoll.torch_backend",
                                    "shmcoll.torch_backend.plugin", "threaded_pg.plugin"])
def test_import_is_torch_and_numba_free(module):
    proc = subprocess.run([sys.executable, "-c", LIGHT_IMPORT_SCRIPT.format(module=module)],
                          capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def _top_level_imports(path):
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    return {m for m, _, node in _imports(path, tree) if id(node) in top}


LAZY_API_SCRIPT = """
import sys
import shmcoll, threaded_pg
assert "torch" not in sys.modules and "numba" not in sys.modules
from shmcoll import *  # noqa
assert Group.__module__ == "shmcoll.engine.group" and issubclass(PeerLostError, ShmcollError)
assert ReduceOp.SUM is shmcoll.ReduceOp.SUM and callable(new_shm_group) and FileStore
assert "torch" not in sys.modules  # the engine, not the adapter
assert "numba" not in sys.modules  # nor the kernels: compiled.py imports them on first use
import threaded_pg.spawning, threaded_pg.testing  # submodules first: the names still win
from threaded_pg import *  # noqa
assert spawn is threaded_pg.spawn and spawn.__module__ == "threaded_pg.spawning", spawn
assert callable(ranks) and ThreadedTestCase and rng_lock and run_threads and Rendezvous
from shmcoll.torch_backend.compat import registration_replaces  # "threaded" is ours where
from threaded_pg.plugin import ALIAS, create_threaded_process_group  # others can take it over
claims = registration_replaces(ALIAS, create_threaded_process_group, ["cpu", "cuda"])
assert backend_name() == ("threaded" if claims else ALIAS) and callable(new_threaded_group)
from shmcoll.torch_backend import ProcessGroupShm, ShmOptions, create_shm_process_group
from shmcoll.torch_backend import register, new_process_group, HierProcessGroup
try:
    shmcoll.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("shmcoll.no_such_name")
print("ok")
"""


def test_lazy_names_keep_the_api():
    """PEP 562 names: `from X import *` and attribute access give what the eager imports
    gave; a submodule imported first never shadows a name (threaded_pg.spawn stays the
    function); an unknown name is an AttributeError."""
    proc = subprocess.run([sys.executable, "-c", LAZY_API_SCRIPT], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("path", [p for p in _py_files(PACKAGE)
                                  if any(m.split(".")[0] == "numba"
                                         for m in _top_level_imports(p))],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_numba_modules_import_jit(path):
    """`import shmcoll` no longer imports shmcoll.native.jit (it imports numba): every module that
    imports numba imports jit itself, at the top, so numba has a writable cache directory
    before the module defines a cached kernel. jit.py and the cache class it gives every
    kernel (prebuilt.py, which jit imports and which defines no kernel) excepted."""
    if path in (PACKAGE / "native" / "jit.py", PACKAGE / "native" / "prebuilt.py"):
        return
    assert "shmcoll.native.jit" in _top_level_imports(path), \
        f"shmcoll/{path.relative_to(PACKAGE)} imports numba but not shmcoll.native.jit"


# Modules that may import a numba module (one that imports numba or llvmlite at module
# level) besides the numba modules themselves: the layers' compiled.py, the one way the
# engine reaches a kernel (native's, and protocol's and p2p's, each adding its layer's
# kernels to the ones below); jit.py, whose kernel() / cfunc() (called only by the numba
# modules, as they define their kernels) give each kernel prebuilt's cache; and the tools
# that run apart from any group (the doctor, the wheel's build).
NUMBA_IMPORTERS = {"shmcoll.native.compiled", "shmcoll.protocol.compiled",
                   "shmcoll.p2p.compiled", "shmcoll.native.jit", "shmcoll.tools.doctor",
                   "shmcoll.tools.build_kernels"}


def _numba_modules():
    """shmcoll's modules whose import imports numba: a module-level import of numba,
    llvmlite or of such a module of shmcoll."""
    top = {_module_name(p): _top_level_imports(p) for p in _py_files(PACKAGE)}
    found = {m for m, imports in top.items()
             if any(i.split(".")[0] in ("numba", "llvmlite") for i in imports)}
    while True:
        more = {m for m, imports in top.items() if m not in found and imports & found}
        if not more:
            return found
        found |= more


def test_kernels_are_reached_only_through_compiled():
    """Creating a group imports no numba (the compiled modules; tests/test_warm_init.py runs
    it): no engine module imports a numba module, at any depth of the file, but through a
    layer's compiled.py,
    so that the creation path cannot import one by accident (a lazy import in a function
    of a module on it would run at the first collective, not at creation, but it would
    also bypass the one owner; the warm-up imports them through compiled as well)."""
    numba_modules = _numba_modules()
    assert {"shmcoll.native.atomics", "shmcoll.native.reducers", "shmcoll.protocol.kernels",
            "shmcoll.native.single_copy_kernels", "shmcoll.p2p.cells"} <= numba_modules, numba_modules
    graph = _import_graph()
    bad = sorted((m, sorted(graph[m] & numba_modules)) for m in graph
                 if m.startswith("shmcoll") and m not in numba_modules
                 and m not in NUMBA_IMPORTERS and graph[m] & numba_modules)
    assert not bad, f"import a numba module other than through a layer's compiled module: {bad}"


def test_no_import_circles():
    """STYLE.md §00: no import circles, lazy (function-level) ones included."""
    circles = _circles(_import_graph())
    assert not circles, f"import circles: {[sorted(c) for c in circles]}"


def test_circle_finder_sees_lazy_imports():
    """Guard for test_no_import_circles: a function-level import (ProcessGroupShm's
    `from ..native.pages import ...`) and the lazy names of a package __init__
    are edges."""
    graph = _import_graph()
    assert "shmcoll.native.pages" in graph["shmcoll.torch_backend.hier_pg"]
    assert "shmcoll.torch_backend.process_group" in graph["shmcoll.torch_backend"]
    assert "threaded_pg.spawning" in graph["threaded_pg"]


def test_import_module_calls_are_edges():
    """Guard: importlib.import_module("a.b") counts as an import (the doctor once reached
    cuda_ipc that way, a circle the AST walk did not see)."""
    call = ast.parse('importlib.import_module("cuda_ipc.doctor")').body[0].value
    assert _is_import_module_call(call)
    assert not _is_import_module_call(ast.parse("importlib.import_module(name)").body[0].value)


def test_resolver_sees_relative_imports():
    """Guard for the checks above: the AST walk resolves `from .. import x` forms."""
    mods = {m for m, _, _ in _imports(PACKAGE / "algorithms" / "__init__.py")}
    assert "shmcoll.native.single_copy" in mods and "shmcoll.algorithms.all_reduce" in mods, mods


# -- the layers ------------------------------------------------------------------------------

def _layer(module):
    """The layer of a module of PACKAGES, from its path (see LAYERS)."""
    if module in FRONT:
        return "front"
    parts = module.split(".")
    if parts[0] != "shmcoll":
        return parts[0]
    if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
        return f"shmcoll/{parts[1]}"
    return "shmcoll"


def _upward_imports(graph):
    """'a -> b (layer -> layer)' for every edge of `graph` into a higher layer."""
    return [f"{a} -> {b} ({_layer(a)} -> {_layer(b)})"
            for a in sorted(graph) for b in sorted(graph[a])
            if RANK[_layer(b)] > RANK[_layer(a)]]


def test_every_module_has_a_layer():
    """A new folder under shmcoll/ (or a new top-level package) is placed in LAYERS first."""
    unknown = sorted({_layer(m) for m in _files()} - set(RANK))
    assert not unknown, f"folders with no layer in LAYERS: {unknown}"
    vocabulary = sorted(m for m in _files() if _layer(m) == "shmcoll")
    assert vocabulary == ["shmcoll.config", "shmcoll.errors", "shmcoll.lazy_names"], \
        f"modules directly in shmcoll/ are the vocabulary (or FRONT): {vocabulary}"


def test_imports_only_go_down():
    """STYLE.md §00: no module imports one of a higher layer (function-level and importlib
    imports included, and a package's lazy names)."""
    up = _upward_imports(_import_graph())
    assert not up, "imports up the layers: " + "; ".join(up)


def test_upward_check_sees_an_upward_import():
    """Guard for the check above: the reducers importing Group, a lazy import of the
    doctor from the protocol, cuda_ipc importing threaded_pg are upward; the front importing
    the adapter, algorithms importing the reducers are not."""
    assert len(_upward_imports({"shmcoll.native.reducers": {"shmcoll.engine.group"},
                                "shmcoll.protocol.waits": {"shmcoll.tools.doctor"},
                                "cuda_ipc.rendezvous": {"threaded_pg.arena"}})) == 3
    assert not _upward_imports({"shmcoll": {"shmcoll.torch_backend.plugin"},
                                "shmcoll.algorithms.reduce": {"shmcoll.native.reducers"},
                                "shmcoll.torch_backend.p2p": {"cuda_ipc.p2p"}})


def _private_imports(path, module, tree=None):
    """'file:line module.name' for every `from X import _name` in `path` (of module
    `module`; its parsed `tree` when given) where X is in another package (folder) of
    PACKAGES than the file's."""
    files = _files()

    def folder(m):
        return m if files[m].name == "__init__.py" else m.rpartition(".")[0]

    found = []
    for mod, lineno, node in _imports(path, tree):
        if not isinstance(node, ast.ImportFrom) or mod.split(".")[0] not in PACKAGES:
            continue
        for alias in node.names:
            name = alias.name
            if not name.startswith("_") or name.startswith("__"):
                continue
            source = f"{mod}.{name}" if f"{mod}.{name}" in files else mod
            if source in files and folder(source) != folder(module):
                found.append(f"{path.relative_to(ROOT)}:{lineno} {mod}.{name}")
    return found


def test_no_private_name_from_another_package():
    """STYLE.md §00: a `_private` name is imported only within its own package (folder);
    what another package needs is public."""
    bad = [f for m, p in sorted(_files().items()) for f in _private_imports(p, m)]
    assert not bad, "private names imported from another package: " + "; ".join(bad)


def test_private_check_sees_a_private_import():
    """Guard for the check above: `from ..engine.group_args import _x` in hier/ is seen,
    `from .reduce import _y` inside hier/ is not."""
    hier = PACKAGE / "hier" / "api.py"
    tree = ast.parse("from ..engine.group_args import _x\nfrom .reduce import _y\n")
    assert _private_imports(hier, "shmcoll.hier.api", tree) == \
        ["shmcoll/hier/api.py:1 shmcoll.engine.group_args._x"]


# -- one writer per piece of state (STYLE.md §00, issue 24) -------------------------------

STATE_PACKAGES = PACKAGES
# Not a stop-gap: torch wants ~40 methods on one ProcessGroup class, and the adapter keeps
# them in method tables by kind, which hold no state (test_method_tables_hold_no_state):
# every attribute they read is EngineProcessGroup's, written in process_group.py.
METHOD_TABLES = {
    ("shmcoll/torch_backend/process_group.py", "EngineProcessGroup"): {
        "ReduceMixin", "MovementMixin", "GatherScatterMixin", "P2PMixin", "BarrierMixin"},
}

def _state_files():
    return {_module_name(p): p for d in STATE_PACKAGES for p in _py_files(ROOT / d)}


def _classes():
    """{(module, class name): (path, ClassDef, {base name: (module, class) or None})} over
    STATE_PACKAGES; a base is resolved through the module's own classes and its
    `from X import Name` imports (None: defined elsewhere, e.g. torch's)."""
    files = _state_files()
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in files.items()}
    local = {m: {n.name for n in t.body if isinstance(n, ast.ClassDef)}
             for m, t in trees.items()}
    found = {}
    for module, tree in trees.items():
        imported = {}
        for mod, _, node in _imports(files[module], tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    imported[alias.asname or alias.name] = (mod, alias.name)
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {}
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else \
                    base.attr if isinstance(base, ast.Attribute) else None
                if name is None:
                    continue
                if isinstance(base, ast.Name) and name in local[module]:
                    bases[name] = (module, name)
                elif isinstance(base, ast.Name) and name in imported and \
                        name in local.get(imported[name][0], ()):
                    bases[name] = (imported[name][0], imported[name][1])
                else:
                    bases[name] = None
            found[(module, node.name)] = (files[module], node, bases)
    return found


def _self_writes(cls):
    """{attribute: line} of every `self.X = / += / :` in the methods of ClassDef `cls`
    (closures inside a method included: they write the same object)."""
    writes = {}
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
            continue
        me = fn.args.args[0].arg
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == me:
                writes.setdefault(node.attr, node.lineno)
    return writes


def _writers_by_file(key, classes):
    """({attribute: {file: line}}, names of the classes walked) for class `key` and every
    base of it defined here."""
    out, todo, seen = {}, [key], set()
    while todo:
        k = todo.pop()
        if k in seen or k not in classes:
            continue
        seen.add(k)
        path, node, bases = classes[k]
        rel = str(path.relative_to(ROOT))
        for attr, line in _self_writes(node).items():
            out.setdefault(attr, {}).setdefault(rel, line)
        todo.extend(b for b in bases.values() if b is not None)
    return out, {name for _, name in seen}


def test_no_mixins():
    """STYLE.md §00: an object is split by giving a collaborator its own state, never by
    moving methods that share `self` into other files: no class inherits a *Mixin, but the
    adapter's method tables (METHOD_TABLES, which hold no state)."""
    bad = []
    for (module, name), (path, node, bases) in sorted(_classes().items()):
        rel = str(path.relative_to(ROOT))
        allowed = METHOD_TABLES.get((rel, name), set())
        bad += [f"{rel}:{node.lineno} class {name}({b})" for b in bases
                if b.endswith("Mixin") and b not in allowed]
    assert not bad, "classes built from mixins (STYLE.md §00): " + "; ".join(bad)


def test_method_tables_hold_no_state():
    """The adapter's method tables (METHOD_TABLES) assign no attribute of `self` (nor
    `setattr` it): they are methods of EngineProcessGroup kept by kind, its state is
    written in process_group.py only."""
    classes = _classes()
    bad, seen = [], 0
    for (host_file, host), tables in METHOD_TABLES.items():
        for (module, name), (path, node, _) in classes.items():
            if name not in tables or not str(path).startswith(str(ROOT / "shmcoll/torch_backend")):
                continue
            seen += 1
            for sub in ast.walk(node):
                targets = (sub.targets if isinstance(sub, ast.Assign) else
                           [sub.target] if isinstance(sub, (ast.AugAssign, ast.AnnAssign))
                           else [])
                for t in targets:
                    for leaf in ast.walk(t):
                        if isinstance(leaf, ast.Attribute) and \
                                isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                            bad.append(f"{path.name}:{leaf.lineno} {name} writes self.{leaf.attr}")
                if isinstance(sub, ast.Call) and getattr(sub.func, "id", None) == "setattr" \
                        and sub.args and getattr(sub.args[0], "id", None) == "self":
                    bad.append(f"{path.name}:{sub.lineno} {name} calls setattr(self, ...)")
    assert seen == sum(len(t) for t in METHOD_TABLES.values()), seen
    assert not bad, "method tables that hold state: " + "; ".join(bad)


def test_one_writer_per_attribute():
    """STYLE.md §00: every attribute of an object is assigned (`self.X = ...`) in one file,
    counting the class and its bases defined in other files (a subclass that assigns its
    base's attribute, or a mixin that assigns its host's, is a second writer)."""
    classes = _classes()
    bad = []
    for key, (path, node, _) in sorted(classes.items()):
        writers, _ = _writers_by_file(key, classes)
        for attr, where in sorted(writers.items()):
            if len(where) > 1:
                bad.append(f"{node.name}.{attr}: " +
                           ", ".join(f"{f}:{line}" for f, line in sorted(where.items())))
    assert not bad, "attributes written from more than one file: " + "; ".join(bad)


def test_one_writer_check_sees_closures_and_bases():
    """Guard for the two checks above: a closure's `self.X = ` counts, bases resolve through
    relative imports, and a mixin base is seen."""
    tree = ast.parse("class C:\n    def m(self):\n        def f():\n            self.x = 1\n"
                     "        self.y += 1\n")
    assert set(_self_writes(tree.body[0])) == {"x", "y"}
    classes = _classes()
    assert classes[("threaded_pg.backend", "RankThreadExecutor")][2]["Executor"] == \
        ("shmcoll.torch_backend.executor", "Executor")
    assert "ReduceMixin" in classes[("shmcoll.torch_backend.process_group",
                                     "EngineProcessGroup")][2]
