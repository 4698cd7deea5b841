"""FileStore: a minimal key-value rendezvous store in a directory, for numpy-only users.

It offers the three calls the engine needs from a c10d Store: set, get (blocking, with a
timeout) and add. Any object with those methods works, e.g. torch.distributed.TCPStore.
"""

import base64
import fcntl
import os
import time

__all__ = ["FileStore"]


class FileStore:
    """Keys are files in `path` (shared by every rank); writes are atomic renames."""

    def __init__(self, path, timeout_s=300.0):
        self.path = path
        self.timeout_s = timeout_s
        os.makedirs(path, mode=0o700, exist_ok=True)

    def _file(self, key):
        return os.path.join(self.path, base64.urlsafe_b64encode(key.encode()).decode())

    def set(self, key, value):
        data = value.encode() if isinstance(value, str) else bytes(value)
        tmp = f"{self._file(key)}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self._file(key))

    def get(self, key):
        deadline = time.monotonic() + self.timeout_s
        delay = 1e-4
        while True:
            try:
                with open(self._file(key), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"FileStore.get({key!r}): timed out after "
                                       f"{self.timeout_s} s in {self.path}") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.01)

    def check(self, keys):
        """True when every key in `keys` is set (never blocks), as c10d Store.check."""
        return all(os.path.exists(self._file(k)) for k in keys)

    def add(self, key, amount):
        with open(self._file(key) + ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with open(self._file(key), "rb") as f:
                    value = int(f.read() or b"0")
            except FileNotFoundError:
                value = 0
            value += int(amount)
            self.set(key, str(value))
            return value
