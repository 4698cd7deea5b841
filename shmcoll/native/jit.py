"""Where numba caches shmcoll's compiled kernels, and the lock ranks compile them under.

Every kernel is made by `kernel(...)` (numba.njit) or `cfunc(sig, fn)` (numba.cfunc), which
give it prebuilt.KernelCache: it loads the kernels a wheel ships (compiled when the wheel
was built, prebuilt.py) where they match this install, else numba's cache as below.
Without shipped kernels, the first process that needs one compiles it (~0.05-1 s) and
writes it to numba's cache; every later process loads it (~10 ms). numba picks the cache
directory per source file: `NUMBA_CACHE_DIR` when set, else `__pycache__` next to the
sources when writable, else a per-user directory (~/.cache/numba). When none of these is
writable (a read-only image whose HOME is read-only too) numba would refuse to define the
kernels at import; `_ensure_cache_dir` then points it at a private directory under the
temp dir instead (logged once).

compiling(what) holds the job's compile lock: a lock for the rank threads of this process,
and an exclusive flock on `<cache dir>/shmcoll-compile.lock` for the processes sharing the
cache. So the ranks of a job never compile the same kernel at the same time: one compiles
and writes numba's cache, the others wait and then load the result (numba looks in its
cache before it compiles). The kernel drops a flock when its holder dies, so a killed rank
never leaves the lock held; a waiter gives up after SHMCOLL_COMPILE_TIMEOUT_S with a
CollectiveTimeoutError naming what it waited for and the holder's pid.

Importing this module imports no numba (nor prebuilt.py, which does): `once` and `is_done`
are on the path of every collective, and a group's creation imports no numba
(compiled.py). The first `kernel` / `cfunc`, run as a kernel module defines its kernels,
imports it and gives it a cache directory.
"""

import contextlib
import fcntl
import logging
import os
import stat
import tempfile
import threading
import time

from .. import config
from ..errors import CollectiveTimeoutError

__all__ = ["kernel", "cfunc", "ready", "compiling", "once", "is_done", "cache_dir",
           "cached_entries", "LOCK_NAME"]

log = logging.getLogger(__name__)

LOCK_NAME = "shmcoll-compile.lock"
# Polling interval of a waiter: a compile takes 50 ms to seconds, a load ~10 ms after it.
_POLL_MIN_S, _POLL_MAX_S = 0.005, 0.05

_tlock = threading.RLock()  # rank threads of this process; numba's own lock is global too
_depth = 0  # nesting of compiling() in the thread that holds _tlock
_fd = None  # the lock file, opened once per process (reopened after a fork); False: none


def kernel(**options):
    """Decorator: numba.njit(**options) with shmcoll's kernel cache (the shipped kernels,
    then numba's cache; prebuilt.py) instead of cache=True."""
    numba = _numba()
    from numba.core.dispatcher import Dispatcher

    from . import prebuilt

    def decorate(fn):
        disp = numba.njit(**options)(fn)
        if isinstance(disp, Dispatcher):  # not under NUMBA_DISABLE_JIT
            disp._cache = prebuilt.KernelCache(fn)
        return disp
    return decorate


def cfunc(sig, fn):
    """numba.cfunc(sig)(fn) with shmcoll's kernel cache, loaded or compiled now (as
    numba.cfunc does)."""
    _numba()
    from numba.core import sigutils
    from numba.core.ccallback import CFunc

    from . import prebuilt
    cf = CFunc(fn, sigutils.normalize_signature(sig), locals={}, options={})
    cf._cache = prebuilt.KernelCache(fn)
    cf.compile()
    return cf


_numba_ready = False  # whether _numba() has given numba a cache directory


def _numba():
    """numba, imported here, by the first kernel a module defines (this module imports no
    numba: `jit.once` and the compile lock are on the path of every collective, and the
    creation of a group must not import numba; compiled.py), with a writable cache
    directory for shmcoll's kernels (_ensure_cache_dir) before any is defined."""
    global _numba_ready
    import numba
    if not _numba_ready:
        _ensure_cache_dir()
        _numba_ready = True
    return numba


def ready():
    """Import numba and make its CPU target able to load kernels, and no more: its target
    context and runtime (prebuilt.ready_runtime), as numba's first load would. Compiles
    nothing and loads none of numba's typing and lowering registries (only a compilation
    reads them, and loads them itself). ~0.3 s warm on the 2-core VM, nearly all of it
    numba's import.

    Lock order as numba's: the target context first (its lazy property holds its own lock
    while the context's creation takes numba's compiler lock), then the compiler lock
    (rtsys.initialize takes it), never the property inside the compiler lock: a thread
    defining its first numba function (a kernel module's import, or the user's own
    @njit) takes them in that order, and a warm-up that took the compiler lock first
    deadlocked with it."""
    _numba()
    from numba.core.registry import cpu_target

    from . import prebuilt
    prebuilt.ready_runtime(cpu_target.target_context)


def _probe():
    """Stands for every shmcoll kernel: numba locates the cache per source directory."""


def _cache_path():
    """numba's locator's pick for this package (checked with numba 0.68); RuntimeError
    when numba finds no writable place, another error where its internals differ."""
    from numba.core.caching import FunctionCache
    return FunctionCache(_probe)._cache_path


def cache_dir():
    """The directory numba caches shmcoll's kernels in, or None when unknown."""
    try:
        return _cache_path()
    except Exception:  # noqa: BLE001 -- a different numba layout: no lock file, no doctor line
        return None


def cached_entries(py_func):
    """How many compiled versions of `py_func` numba's cache holds that this process could
    load (same numba and Python, unchanged source, this CPU); None where numba's cache
    internals are not where this numba version was read (0.68: the index pickles
    (stamp, {(signature, codegen magic, code hashes): data file})). Loads nothing."""
    try:
        from numba.core.caching import FunctionCache
        from numba.core.registry import cpu_target
        magic = cpu_target.target_context.codegen().magic_tuple()
        index = FunctionCache(py_func)._cache_file._load_index()  # {} when stale
        return sum(1 for key in index if key[1] == magic)
    except Exception:  # noqa: BLE001 -- another numba layout: the doctor says "unknown"
        return None


def _ensure_cache_dir():
    """Give numba a writable cache directory when it finds none for this package."""
    import numba
    if numba.config.CACHE_DIR:
        return
    try:
        _cache_path()
        return
    except RuntimeError:  # "no locator available": numba would refuse to define the kernels
        pass
    except Exception:  # noqa: BLE001 -- another numba layout: leave its choice alone
        return
    path = os.path.join(tempfile.gettempdir(), f"shmcoll-numba-cache-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    # Cache files are pickles numba executes: never take a directory another user controls.
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        path = tempfile.mkdtemp(prefix="shmcoll-numba-cache-")
    numba.config.CACHE_DIR = path
    log.warning("shmcoll: no writable numba cache directory next to the package or in the "
                "user's cache directory; compiled kernels go to %s (set NUMBA_CACHE_DIR to "
                "a persistent writable directory to keep them across runs)", path)


def _lock_fd():
    """The lock file's descriptor, or None where there can be none (said once)."""
    global _fd
    if _fd is None:
        _numba()  # the lock lies in numba's cache directory for shmcoll (given one first)
        where = cache_dir()
        try:
            if where is None:
                raise OSError("numba's cache location is unknown")
            _fd = os.open(os.path.join(where, LOCK_NAME),
                          os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            _no_lock(e)
    return _fd or None


def _no_lock(error):
    global _fd
    log.warning("shmcoll: no compile lock in %s (%s): ranks may compile the same kernels at "
                "the same time", cache_dir(), error)
    if _fd:
        os.close(_fd)
    _fd = False


def _forget_lock_fd():
    """After fork: the child must not share the parent's open file (and lock) description."""
    global _fd, _depth
    if _fd:
        try:
            os.close(_fd)
        except OSError:
            pass
    _fd, _depth = None, 0


os.register_at_fork(after_in_child=_forget_lock_fd)


def _holder(fd):
    try:
        return os.pread(fd, 32, 0).decode().strip() or "unknown"
    except (OSError, UnicodeDecodeError):
        return "unknown"


def _timeout(what, waited_s, holder):
    return CollectiveTimeoutError(
        f"compiling {what}: waited {waited_s:.0f} s for shmcoll's kernel compile lock, held "
        f"by pid {holder} ({cache_dir()}/{LOCK_NAME}); that process compiles kernels into "
        f"the same numba cache. Raise SHMCOLL_COMPILE_TIMEOUT_S, or run `python -m "
        f"shmcoll.engine.warmup` once before the job")


def _flock(fd, what, deadline, t0):
    """Take the file lock (True), or False where the filesystem has no flock (ENOLCK on
    some network filesystems): then ranks may compile the same kernel, nothing worse."""
    poll = _POLL_MIN_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise _timeout(what, time.monotonic() - t0, _holder(fd)) from None
            time.sleep(poll)
            poll = min(poll * 2, _POLL_MAX_S)
            continue
        except OSError as e:
            _no_lock(e)
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return True


@contextlib.contextmanager
def compiling(what):
    """Hold the job's compile lock (see the module docstring) while compiling `what`
    (named in the timeout error); reentrant in the holding thread."""
    global _depth
    t0 = time.monotonic()
    deadline = t0 + config.compile_timeout_s()
    if not _tlock.acquire(timeout=max(0.0, deadline - t0)):
        raise _timeout(what, time.monotonic() - t0, f"{os.getpid()} (another thread)")
    try:
        fd = _lock_fd() if _depth == 0 else None
        if fd is not None and not _flock(fd, what, deadline, t0):
            fd = None
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        _tlock.release()


_done = set()  # what once() has built in this process


def once(what, build):
    """Call build() (compiling or loading `what`) once per process, under the compile
    lock; later calls cost a set lookup."""
    if what in _done:
        return
    with compiling(what):
        if what not in _done:
            build()
            _done.add(what)


def is_done(what):
    """Whether once(what, ...) has built it in this process."""
    return what in _done

