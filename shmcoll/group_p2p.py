"""The engine Group's point-to-point calls (P2PMixin): send/recv through per-pair mailboxes
driven by the P2PEngine's progress thread (p2p.py). P2P consumes no seq number and touches
no step counter, so it interleaves freely with collectives. Timeouts, lost peers and aborts
poison the group as collectives do.
"""

import numpy as np

from .errors import ShmcollError
from .group_args import _bytes, _Flat


class P2PMixin:
    """send / recv / isend / irecv / recv_any of group.Group (see the module docstring)."""

    def attach_p2p(self, engine):
        """Use `engine` (a p2p.P2PEngine; new_shm_group wires it) for send/recv."""
        self._p2p = engine

        def failed(error):
            if self._poison is None:
                self._poison = error
        engine.on_fatal = failed

    def isend(self, array, dst, tag=0, timeout_s=None):
        """Start sending `array` to rank `dst`; returns a p2p.Request (wait() -> None).
        Completes once the data is in the mailbox; do not modify `array` before that."""
        engine = self._p2p_engine("send", dst, "destination")
        data = _bytes(np.ascontiguousarray(array))
        return engine.isend(data, dst, tag, self._p2p_timeout(timeout_s))

    def irecv(self, array, src=None, tag=0, timeout_s=None):
        """Start receiving into `array` from rank `src` (None: any rank); returns a
        p2p.Request whose wait() returns the sender's rank."""
        engine = self._p2p_engine("recv", src, "source")
        f = _Flat(array, array.dtype, copy_in=False)
        return engine.irecv(_bytes(f.flat), src, tag, self._p2p_timeout(timeout_s),
                            f.write_back if f._copied else None)

    def send(self, array, dst, tag=0, timeout_s=None):
        """Send `array` to rank `dst` (returns once it is in the mailbox, not when received)."""
        self.isend(array, dst, tag, timeout_s).wait()

    def recv(self, array, src, tag=0, timeout_s=None):
        """Receive into `array` from rank `src`; returns src."""
        return self.irecv(array, src, tag, timeout_s).wait()

    def recv_any(self, array, tag=0, timeout_s=None):
        """Receive into `array` from whichever rank sends first with `tag`; returns its rank."""
        return self.irecv(array, None, tag, timeout_s).wait()

    def _p2p_engine(self, name, peer, what):
        self._usable(name)
        engine = getattr(self, "_p2p", None)
        if engine is None:
            raise ShmcollError(f"{name}: this group has no point-to-point engine")
        if peer is not None and not 0 <= peer < self.world_size:
            raise ValueError(f"{name}: invalid {what} rank {peer} (world size {self.world_size})")
        return engine

    def _p2p_timeout(self, timeout_s):
        return self.timeout_s if timeout_s is None else float(timeout_s)
