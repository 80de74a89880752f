"""Mbarrier hand-overs between a kernel's warpgroups, simulated step by step on CPU (``test_*_protocol``): PTX's
phase-parity rule, and a scheduler that runs the parties under a fixed or a random order."""

import random


class Barrier:
    """An mbarrier by phase: a phase completes when ``count`` parties have arrived; a wait on parity p passes once
    the current phase has parity other than p."""

    def __init__(self, count=1):
        self.phase, self.count, self.pending = 0, count, 0

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.phase, self.pending = self.phase + 1, 0

    def passes(self, parity):
        return (self.phase & 1) != parity

    def wait(self, parity):
        """A party's wait, for ``yield from``: it yields False (no move) until the wait passes."""
        while not self.passes(parity):
            yield False


class Slot:
    """A one-item buffer handed over by two mbarriers: the writer arrives on ``full`` once it has put item g, the
    reader on ``free`` once it has read it. ``put`` and ``take`` (for ``yield from``) wait with the parity given and
    raise the overwrite or the stale read they find; ``what`` and the verbs name them in the messages."""

    def __init__(self, what, put_verb, reader):
        self.full, self.free = Barrier(), Barrier()
        self.item, self.read = None, -1
        self.what, self.put_verb, self.reader = what, put_verb, reader

    def put(self, g, parity):
        """Put item g, first waiting on ``free`` with ``parity`` (None: the first item, nothing to wait for)."""
        if parity is not None:
            yield from self.free.wait(parity)
        if self.read != g - 1:
            raise AssertionError(f"{self.what} {g} {self.put_verb} over {self.what} {g - 1}, which {self.reader} had "
                                 "not read")
        self.item = g
        self.full.arrive()

    def take(self, g, parity):
        """Read item g once ``full``'s wait on ``parity`` passes."""
        yield from self.full.wait(parity)
        if self.item != g:
            raise AssertionError(f"{self.what} {g} read while the buffer held {self.what} {self.item}")
        self.read = g
        self.free.arrive()


def schedule(parties, order, policy, seed, progress):
    """Run ``parties`` (name: a generator that yields True when it moved, False when it waits) to the end, the first
    in ``order`` that can move moving each step (``order`` shuffled each step when ``policy`` is "random"). Returns
    None, the AssertionError's message a party raised (an overwrite), or "deadlock: ..." with ``progress()``."""
    rng = random.Random(seed)
    try:
        while parties:
            turn = [n for n in order if n in parties]
            if policy == "random":
                rng.shuffle(turn)
            for name in turn:
                try:
                    moved = next(parties[name])
                except StopIteration:
                    del parties[name]
                    break
                if moved:
                    break
            else:
                return f"deadlock: {', '.join(sorted(parties))} waiting, {progress()}"
    except AssertionError as exc:
        return str(exc)
    return None
