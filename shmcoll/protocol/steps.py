"""The Arena's own bookkeeping, in two objects that each alone write their state:

- `StepClock`: where this rank stands in the step sequence -- its last posted step, the
  step every peer is known to have posted, the slot rotation and when each slot is free
  again (rules 2, 3 and 6 of protocol.py's docstring);
- `Frame`: the collective in progress -- seq, name, timeout and deadline, and its
  fingerprint words, whether they are written out yet and whether the peers' are checked
  yet (rules 1 and 4). Arena.one_step's kernel frames its collective itself and opens
  the Frame only when Python takes over (a slot to wait for, a late peer); between
  collectives the Frame holds the last one Python framed.

Neither touches shared memory: protocol.Arena moves the words and calls these to record
what it did. Other packages read the frame through `Arena.frame` (cuda_ipc's inline
stream guard: the collective's name, seq and timeout).
"""

import time

from .layout import FP_WORDS

__all__ = ["StepClock", "Frame"]

_FP_PAD = [[0] * (FP_WORDS - n) for n in range(FP_WORDS + 1)]


class StepClock:
    """This rank's steps and slots. `step`: my last posted step (only I write my POSTED);
    `known_min`: every peer has posted at least this; `next_slot`: the slot the next chunk
    uses (the same rotation on every rank); `free_at[i]`: the step every peer must have
    posted before my slot i may be written again (rule 6). Read them freely; only these
    methods write them."""

    __slots__ = ("step", "known_min", "next_slot", "free_at", "nslots")

    def __init__(self, step, nslots):
        self.step = step
        self.known_min = step
        self.nslots = nslots
        self.next_slot = 0
        self.free_at = [0] * nslots

    def take_slot(self):
        """The slot the next chunk uses; the rotation moves on."""
        i = self.next_slot
        self.next_slot = (i + 1) % self.nslots
        return i

    def hold(self, i, step):
        """Slot i is read by peers until every one of them has posted `step`."""
        self.free_at[i] = step

    def posted(self, step, slot=None):
        """I posted `step`; `slot` (if any) was published by it: free once every peer has
        posted the next step."""
        self.step = step
        if slot is not None:
            self.free_at[slot] = step + 1

    def arrived(self, step):
        """Every peer has posted `step`."""
        self.known_min = step

    def reached(self, step):
        """I posted `step` and every peer has too (a multi-step kernel's clean pass)."""
        self.step = self.known_min = step

    def one_step(self, i, step, publishes, arrived):
        """Arena.one_step's bookkeeping in one call: slot i taken, `step` posted (slot i
        published by it when `publishes`), and, when `arrived`, every peer posted it."""
        self.next_slot = i + 1 if i + 1 < self.nslots else 0
        if publishes:
            self.free_at[i] = step + 1
        self.step = step
        if arrived:
            self.known_min = step

    def rewind(self, slot):
        """Undo a collective's slot rotation after a fingerprint mismatch (rule 4): the
        rotation restarts at `slot`, where the collective began. Slots it published were
        read by nobody (every peer raises at the same wait), and every peer has posted >=
        known_min, so they are free again now; keeping their "free at step + 1" would make
        the next collective's claim wait for a post that comes only after that claim."""
        self.next_slot = slot
        self.free_at = [min(f, self.known_min) for f in self.free_at]


class Frame:
    """The collective in progress: `seq`, `name`, `timeout_s` and `deadline` (monotonic),
    `fp` (its fingerprint words: seq, step at begin, then the collective's), `unwritten`
    (fp not yet in my control block: the first post writes it), `pending` (the peers'
    fingerprints not yet checked: the first wait after the first post checks them),
    `begin_step` and `slot_at_begin` (my step and slot rotation when it began). Read them
    freely; only these methods write them."""

    __slots__ = ("seq", "name", "timeout_s", "deadline", "fp", "unwritten", "pending",
                 "begin_step", "slot_at_begin")

    def __init__(self):
        self.seq = 0
        self.name = "?"
        self.timeout_s = 0.0
        self.deadline = float("inf")
        self.fp = []
        self.unwritten = False
        self.pending = False
        self.begin_step = 0
        self.slot_at_begin = 0

    def open(self, seq, name, fp, timeout_s, step, next_slot):
        """Arena.begin: collective `seq` starts at `step` with the slot rotation at
        `next_slot`; `fp`: its fingerprint words (ints) after seq and step."""
        self.seq = seq
        self.name = name
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        fp = [seq, step, *map(int, fp)]
        if len(fp) < FP_WORDS:
            fp += _FP_PAD[len(fp)]
        self.fp = fp
        self.unwritten = True
        self.pending = True
        self.begin_step = step
        self.slot_at_begin = next_slot

    def open_compiled(self, seq, name, timeout_s, deadline):
        """Arena.one_step before its kernel, when it must wait for its slot first: the
        kernel will write and check this collective's fingerprint itself, so nothing is
        pending."""
        self.seq = seq
        self.name = name
        self.timeout_s = timeout_s
        self.deadline = deadline
        self.pending = False

    def reopen(self, seq, name, timeout_s, deadline, fp, begin_step, slot):
        """Arena.one_step after its kernel posted but did not finish: the state begin()
        would have left, the fingerprint `fp` (all FP_WORDS words) already written by the
        kernel, its check still pending."""
        self.seq = seq
        self.name = name
        self.timeout_s = timeout_s
        self.deadline = deadline
        self.fp = fp
        self.unwritten = False
        self.pending = True
        self.begin_step = begin_step
        self.slot_at_begin = slot

    def written(self):
        """The fingerprint is in my control block (rule 1)."""
        self.unwritten = False

    def checked(self):
        """The peers' fingerprints are checked (rule 4), or need no check."""
        self.pending = False
