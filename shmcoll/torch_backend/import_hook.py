"""Run a function once a module has been imported, without importing it: `after_import`.

`import shmcoll` (and `import threaded_pg`) registers its torch.distributed backend without
importing torch. Where torch is already imported that is immediate; where it is not, the
registration waits for torch.distributed here. (With torch >= 2.5 the `torch.backends` entry
point registers at the end of `import torch` anyway; this covers TORCH_DEVICE_BACKEND_AUTOLOAD=0
and torch 2.4, which has no autoload.)

How: a finder at the front of `sys.meta_path` that finds nothing itself. When the watched
module is about to be imported, it asks the finders behind it for the module's spec and
wraps that spec's loader's `exec_module` (an attribute of that one loader object, removed
again once the module has run), so the callbacks run right after the module's own code, in
the importing thread, under the import lock of that module. The finder then leaves
`sys.meta_path`. Every other import meanwhile costs one call that compares a name
(`python -m benchmarks.import_time` measures what all this adds to `import torch`).

Stdlib only, imports nothing at import time: this module is on the path of `import torch`.
"""

import sys
import threading
import warnings

__all__ = ["after_import"]

_lock = threading.Lock()
_watchers = {}  # module name -> its _Watcher, while one waits in sys.meta_path


def after_import(name, callback):
    """Call callback() now if module `name` is imported, else right after its import
    completes (once; a failed import keeps waiting for the next one). Whatever the callback
    raises is turned into a warning: it may run inside somebody else's import statement."""
    with _lock:
        if sys.modules.get(name) is None:
            watcher = _watchers.get(name)
            if watcher is None:
                watcher = _watchers[name] = _Watcher(name)
                sys.meta_path.insert(0, watcher)
            watcher.callbacks.append(callback)
            return
    _call(callback)


def _call(callback):
    try:
        callback()
    except Exception as e:  # noqa: BLE001 -- never fail the import that triggered it
        _warn(f"{getattr(callback, '__qualname__', callback)} failed after the import it "
              f"waited for: {type(e).__name__}: {e}")


def _warn(message):
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    except Exception:  # noqa: BLE001 -- warnings turned into errors: still never raise
        pass


class _Watcher:
    """The meta-path finder behind after_import, for one module name."""

    def __init__(self, name):
        self.name = name
        self.callbacks = []
        self._finding = False  # our own find_spec calls come back here: answer None

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._finding:
            return None
        self._finding = True
        try:
            spec = self._spec_from_others(fullname, path, target)
        finally:
            self._finding = False
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec  # (None: the import fails as it would have; a loader without
            # exec_module, never seen for torch: no callbacks, nothing else changes)
        try:
            loader.exec_module = self._exec_module(loader, exec_module)
        except (AttributeError, TypeError):  # a loader that takes no attributes
            _warn(f"cannot watch the import of {fullname!r} (loader {loader!r})")
        return spec

    def _spec_from_others(self, fullname, path, target):
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def _exec_module(self, loader, exec_module):
        def exec_then_call(module):
            try:
                exec_module(module)
            finally:
                try:
                    del loader.exec_module  # the loader's own method again
                except AttributeError:
                    pass
            self._done()
        return exec_then_call

    def _done(self):
        with _lock:
            if _watchers.get(self.name) is self:
                del _watchers[self.name]
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
            callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            _call(callback)
