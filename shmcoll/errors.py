"""The exception hierarchy of shmcoll; no logic lives here.

ShmcollError(RuntimeError)                      base: catch this to catch everything of ours
├── CollectiveTimeoutError(ShmcollError, TimeoutError)   a wait passed its deadline
├── PeerLostError(ShmcollError)                 a peer process/thread is gone or closed the group
├── GroupAbortedError(ShmcollError)             the group was aborted (locally or by a peer)
├── CollectiveMismatchError(ShmcollError, ValueError)     ranks disagree at the same seq
└── SegmentError(ShmcollError, OSError)         create/attach/verify/unlink of a segment failed

Bad arguments raise the built-in TypeError / ValueError. Which errors poison a group
(every later call re-raises them) is decided in group.py: timeouts, lost peers and aborts do;
mismatches and argument errors do not (no shared state was touched).
"""

__all__ = [
    "ShmcollError",
    "CollectiveTimeoutError",
    "PeerLostError",
    "GroupAbortedError",
    "CollectiveMismatchError",
    "SegmentError",
]


class ShmcollError(RuntimeError):
    """Base class of every error raised by shmcoll itself."""


class CollectiveTimeoutError(ShmcollError, TimeoutError):
    """A wait passed its deadline; the message names collective, seq, rank and peers."""


class PeerLostError(ShmcollError):
    """A peer exited, was killed, or closed the group while this rank waited for it."""

    def __init__(self, message, peer=None):
        super().__init__(message)
        self.peer = peer


class GroupAbortedError(ShmcollError):
    """The group was aborted, by this process (abort()/shutdown) or by a failing peer."""


class CollectiveMismatchError(ShmcollError, ValueError):
    """Ranks called different collectives (or shapes, dtypes, roots, ops) at the same seq."""


class SegmentError(ShmcollError, OSError):
    """A shared-memory segment could not be created, attached, verified or removed."""
