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
