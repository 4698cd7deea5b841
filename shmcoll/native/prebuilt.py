"""Kernels compiled when the wheel is built, so that a fresh install loads them instead of
compiling them (docs/COLD_START.md).

The wheel carries every shmcoll kernel -- what `python -m shmcoll.engine.warmup` compiles -- in
`shmcoll/_kernels/<cpu>/`: numba's own cache files (an index `.nbi` and a data file `.nbc`
per compiled version) compiled for a portable target CPU rather than the build machine's
(TARGETS: on x86-64, x86-64-v3, which every x86-64 CPU with AVX2 runs), and a
`manifest.json`. Each kernel's cache (KernelCache; jit.kernel and jit.cfunc attach it)
looks there first; what it does not find there it loads from numba's own cache, or
compiles and saves there, as before.

They are loaded only where everything they were compiled from matches, by content: the
manifest holds a key -- a hash of every .py file of the package, the numba, llvmlite and
Python versions, the architecture and the target CPU -- and the installed package must
give the same key, on a CPU with the target's features (status()). A kernel's code comes
from its own file but also from what it calls or reads in others (atomics' intrinsics,
protocol_layout's constants), so the whole package is hashed: an edit anywhere, another
numba, another architecture or an older CPU makes every kernel compile as before (numba's
own cache hashes only the function's own file). A source tree or an editable install has
no `_kernels/`. numba's checks of each entry stay: its index key holds the function's
bytecode and closure contents (and the shipped target where it would hold this CPU's name
and features); a file that fails to load turns the shipped kernels off for the process,
with a warning, and the kernels compile.

Either cache loads a kernel without numba's typing and lowering registries (ready_runtime:
numba's own load imports them all first, ~0.7 s of a warm first collective's ~1.1 s on the
2-core VM); a compilation still loads them, numba's compiler does.

Built by tools/build_kernels.py (setup.py, when the wheel is built): child processes compile
them with NUMBA_CPU_NAME=<target>, NUMBA_CPU_FEATURES='' and BUILD_ENV set, which makes
every KernelCache read and write the build directory only.
"""

import hashlib
import inspect
import json
import logging
import os
import platform
import sys
import threading
from pathlib import Path

import llvmlite
import numba
from llvmlite import binding as ll
from numba.core import caching
from numba.core.runtime import rtsys as _runtime

__all__ = ["KernelCache", "Status", "status", "counts", "building", "targets", "fields", "key",
           "missing_features", "sources_digest", "ready_runtime", "CompileRecorder",
           "DIR_NAME", "MANIFEST"]

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # shmcoll/
DIR_NAME = "_kernels"  # in the package directory: a subdirectory per target CPU
MANIFEST = "manifest.json"
FORMAT = 1  # of the manifest and of what the key covers
BUILD_ENV = "SHMCOLL_PREBUILD_DIR"  # set only in the build's children: where they write

# The CPUs the build compiles for, by architecture (platform.machine()), best first, with
# the host CPU features each needs (LLVM's names, as llvmlite's get_host_cpu_features
# gives them). x86-64-v3 (AVX2, FMA, F16C: Intel Haswell, AMD Zen and later), not the
# x86-64 baseline (numba's "generic": SSE2): the baseline's reducers measured 1.7-3.3x
# slower for bfloat16, 1.9-2.4x for float16 and up to 1.25x for float32 and integer sums,
# x86-64-v3's as fast as this CPU's own (lab/kernel_target.py, docs/COLD_START.md).
X86_64_V3 = ("avx", "avx2", "bmi", "bmi2", "cx16", "f16c", "fma", "lzcnt", "movbe",
             "popcnt", "sahf", "sse3", "sse4.1", "sse4.2", "ssse3", "xsave")
TARGETS = {"x86_64": (("x86-64-v3", X86_64_V3),)}
_BASELINE = (("generic", ()),)  # other architectures: their baseline

_BUILDING = os.environ.get(BUILD_ENV) or None


def targets(machine=None):
    """(cpu, features it needs) the build compiles for on `machine` (default: this one)."""
    return TARGETS.get(machine or platform.machine(), _BASELINE)


# ----------------------------------------------------------------- what matches, or why not

class Status:
    """Whether this process loads shipped kernels: `path` (the target's directory) and
    `stamp` (the key numba's index files must hold) when it does, else None and `reason`."""

    def __init__(self, path=None, reason="", manifest=None):
        self.path, self.reason = path, reason
        self.manifest = manifest or {}
        self.stamp = self.manifest.get("key")
        self.magic = (self.manifest.get("triple"), self.manifest.get("cpu"), "")

    def __repr__(self):
        return f"Status(path={self.path!r}, reason={self.reason!r})"


_lock = threading.Lock()
_status = None
_counts = {"shipped": 0, "cached": 0, "compiled": 0}


def sources_digest(package_dir):
    """sha256 over every .py file under `package_dir`: relative path, size and bytes."""
    h = hashlib.sha256()
    package_dir = Path(package_dir)
    for path in sorted(package_dir.rglob("*.py")):
        data = path.read_bytes()
        h.update(f"{path.relative_to(package_dir).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def fields(cpu, package_dir=PACKAGE_DIR):
    """What kernels shipped for `cpu` must have been compiled from to be loaded here."""
    return {"format": FORMAT, "numba": numba.__version__, "llvmlite": llvmlite.__version__,
            "python": sys.implementation.cache_tag + getattr(sys, "abiflags", ""),
            "triple": ll.get_process_triple(), "cpu": cpu,
            "sources": sources_digest(package_dir)}


def key(f):
    return hashlib.sha256(json.dumps(f, sort_keys=True).encode()).hexdigest()


_WHAT = {"format": "manifest format", "numba": "numba", "llvmlite": "llvmlite",
         "python": "Python", "triple": "architecture", "cpu": "target CPU"}


def missing_features(needs):
    """The features of `needs` this CPU lacks (for numba: NUMBA_ENABLE_AVX counts)."""
    if not needs:
        return []
    if not numba.config.ENABLE_AVX and any(f.startswith("avx") for f in needs):
        return ["AVX (NUMBA_ENABLE_AVX is off)"]
    have = ll.get_host_cpu_features()
    return [f for f in needs if not have.get(f, False)]


def _check_target(package_dir, cpu, needs):
    path = package_dir / DIR_NAME / cpu
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return Status(reason=f"none shipped for {cpu} ({path} does not exist: a source "
                             f"tree, an editable install, or a wheel built without them)")
    except (OSError, ValueError) as e:
        return Status(reason=f"unreadable manifest {path / MANIFEST}: {e}")
    missing = missing_features(needs)
    if missing:
        return Status(reason=f"shipped for {cpu}, which this CPU is not (no "
                             f"{', '.join(missing)})", manifest=manifest)
    here = fields(cpu, package_dir)
    for name, what in _WHAT.items():
        if manifest.get(name) != here[name]:
            return Status(reason=f"built for {what} {manifest.get(name)!r}, this is "
                                 f"{here[name]!r}", manifest=manifest)
    if manifest.get("sources") != here["sources"]:
        return Status(reason=f"the package's sources differ from those they were built from "
                             f"(edited or partly replaced: {package_dir})", manifest=manifest)
    if manifest.get("key") != key(here):
        return Status(reason="manifest key does not match its fields", manifest=manifest)
    return Status(path, manifest=manifest)


def _check(package_dir):
    if _BUILDING:
        f = fields(numba.config.CPU_NAME, package_dir)
        return Status(Path(_BUILDING), "building", dict(f, key=key(f)))
    reasons = []
    for cpu, needs in targets():
        st = _check_target(package_dir, cpu, needs)
        if st.path is not None:
            return st
        reasons.append(st)
    return reasons[0]


def status():
    """This process's Status (decided once)."""
    global _status
    with _lock:
        if _status is None:
            try:
                _status = _check(PACKAGE_DIR)
            except Exception as e:  # noqa: BLE001 -- anything odd: compile, as without them
                _status = Status(reason=f"could not check them: {e!r}")
            if _status.path is None:
                log.debug("shmcoll: shipped kernels not used: %s", _status.reason)
        return _status


def _turn_off(reason):
    global _status
    with _lock:
        if _status is not None and _status.path is not None and not _BUILDING:
            log.warning("shmcoll: shipped kernels turned off, kernels compile instead: %s",
                        reason)
            _status = Status(reason=reason, manifest=_status.manifest)


def building():
    """The directory the build writes the shipped kernels to, in a build child, else None."""
    return _BUILDING


def counts():
    """Kernel versions this process loaded from the shipped kernels, loaded from numba's
    cache, and compiled (each compiled one is also saved to numba's cache)."""
    return dict(_counts)


# ---------------------------------------------------------------------------- the caches

class _Locator(caching.UserProvidedCacheLocator):
    """Files of one function in the shipped directory (the subdirectory of its source
    file's directory in the package), stamped with the key instead of a source hash."""

    def __init__(self, py_func, py_file, path, stamp):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = str(path)
        self._stamp = stamp

    def get_source_stamp(self):
        return self._stamp

    def ensure_cache_path(self):
        if not _BUILDING:
            raise OSError("the shipped kernels are never written after the build")
        os.makedirs(self._cache_path, exist_ok=True)


class _Impl(caching.CompileResultCacheImpl):
    def __init__(self, py_func, locator):  # numba's picks a locator from its list instead
        self._lineno = locator._lineno
        self._locator = locator
        modname = os.path.splitext(os.path.basename(locator._py_file))[0]
        self._filename_base = self.get_filename_base(f"{modname}.{py_func.__qualname__}",
                                                     getattr(sys, "abiflags", ""))

    def reduce(self, cres):
        """numba's serialized CompileResult without its type annotation: the annotated
        source listing that only inspect_types() prints, 43% of the files' bytes and the
        one place they held the build directory's path (numba 0.68's tuple, item 6)."""
        data = super().reduce(cres)
        if len(data) == 9 and isinstance(data[6], str):
            data = data[:6] + ("(a kernel shipped in the wheel: no type annotation kept)",) \
                + data[7:]
        return data


class _ShippedCache(caching.FunctionCache):
    """numba's cache of one function over the shipped directory: index key with the
    shipped target's (triple, cpu, features), where numba puts this process's."""

    def __init__(self, py_func, st):
        py_file = inspect.getfile(py_func)
        rel = os.path.relpath(os.path.dirname(os.path.realpath(py_file)), PACKAGE_DIR)
        if rel.startswith(".."):
            raise ValueError(f"{py_func.__qualname__} is not in {PACKAGE_DIR}")
        self._name = repr(py_func)
        self._py_func = py_func
        self._impl = _Impl(py_func, _Locator(py_func, py_file, st.path / rel, st.stamp))
        self._cache_path = self._impl.locator.get_cache_path()
        self._cache_file = caching.IndexDataCacheFile(
            cache_path=self._cache_path, filename_base=self._impl.filename_base,
            source_stamp=st.stamp)
        self._magic = st.magic
        self.enable()

    def _index_key(self, sig, codegen):
        if _BUILDING and codegen.magic_tuple() != self._magic:
            raise RuntimeError(f"building shipped kernels for {self._magic}, but numba "
                               f"compiles for {codegen.magic_tuple()} (NUMBA_CPU_NAME and "
                               f"NUMBA_CPU_FEATURES='' must be set before numba is imported)")
        sig, _, hashes = super()._index_key(sig, codegen)
        return sig, self._magic, hashes


def ready_runtime(target_context):
    """Make `target_context` able to load a compiled kernel, and no more: numba's runtime
    (NRT: its C helpers' symbols and its compiled refcount functions, ~25 ms), which a
    kernel's array arguments use. numba's own load does target_context.refresh() instead:
    that imports every implementation numba has (its typing and lowering registries,
    scipy's BLAS among them: 0.6-0.7 s of a warm first call's ~1.1 s on the 2-core VM),
    which only a compilation reads -- and numba's compiler does that refresh itself before
    it compiles anything (CompilerBase). What the target context's creation does is
    enough for the rest: the C helpers' and exceptions' symbols, the math functions. Safe
    to call again (numba's initialize returns at once then); takes numba's compiler lock
    (rtsys.initialize does), so the caller must not hold a lock numba takes after it."""
    _runtime.initialize(target_context)


def _load(cache, sig, target_context):
    """cache.load_overload(sig, target_context) without its refresh (ready_runtime); a
    numba whose cache has no _load_overload: its load_overload, refresh and all."""
    load = getattr(cache, "_load_overload", None)
    if load is None:  # pragma: no cover -- read from numba 0.68
        return cache.load_overload(sig, target_context)
    return load(sig, target_context)


class KernelCache(caching.NullCache):
    """The cache of one shmcoll kernel (a dispatcher's or a cfunc's): the shipped kernels
    first, then numba's own cache (FunctionCache), which keeps what this process compiles.
    In the build's child: the shipped directory only, read and written."""

    def __init__(self, py_func):
        self._py_func = py_func
        self._own = None if _BUILDING else caching.FunctionCache(py_func)
        self._shipped = None
        self._looked = False
        self._enabled = True

    @property
    def cache_path(self):
        return self._own.cache_path if self._own is not None else _BUILDING

    def enable(self):
        self._enabled = True

    def disable(self):
        self._enabled = False

    def flush(self):
        if self._own is not None:
            self._own.flush()

    def _shipped_cache(self):
        if not self._looked:  # numba calls load_overload under its compiler lock
            self._looked = True
            st = status()
            if st.path is not None:
                try:
                    self._shipped = _ShippedCache(self._py_func, st)
                except Exception as e:  # noqa: BLE001 -- numba internals not as read
                    if _BUILDING:
                        raise
                    _turn_off(f"{self._py_func.__qualname__}: {e!r}")
        if self._shipped is not None and status().path is None:
            self._shipped = None  # turned off since
        return self._shipped

    def load_overload(self, sig, target_context):
        if not self._enabled:
            return None
        ready_runtime(target_context)
        shipped = self._shipped_cache()
        if shipped is not None:
            try:
                cres = _load(shipped, sig, target_context)
            except Exception as e:  # noqa: BLE001 -- a broken file: compile instead
                if _BUILDING:
                    raise
                _turn_off(f"loading {self._py_func.__qualname__}: {e!r}")
                cres = None
            if cres is not None:
                _counts["shipped" if not _BUILDING else "cached"] += 1
                return cres
        if self._own is None:
            return None
        cres = _load(self._own, sig, target_context)
        if cres is not None:
            _counts["cached"] += 1
        return cres

    def save_overload(self, sig, cres):
        _counts["compiled"] += 1
        if not self._enabled:
            return
        if _BUILDING:
            self._shipped_cache().save_overload(sig, cres)
        else:
            self._own.save_overload(sig, cres)


# ---------------------------------------------------------------------------- counting

class CompileRecorder:
    """Every function numba compiles in this process while installed (its type inference
    pass: dispatchers, cfuncs and numba's own overloads alike), as "module.qualname"."""

    PASS = "nopython_type_inference"

    def __init__(self):
        from numba.core import event
        self.compiled = []
        recorder = self

        class _Listener(event.Listener):
            def on_start(self, ev):
                pass

            def on_end(self, ev):
                if ev.data["name"].startswith(recorder.PASS):
                    recorder.compiled.append(f"{ev.data['module']}.{ev.data['qualname']}")

        self._listener = _Listener()
        event.register("numba:run_pass", self._listener)

    def close(self):
        from numba.core import event
        event.unregister("numba:run_pass", self._listener)
