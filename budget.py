"""budget.py: when engine e may start a group. Staleness: batch k trains at version k, so a group
started at version v is at most max_staleness old then iff at most (v - v0 + max_staleness + 1) *
batch_groups started since v0, net of discards (flat or stale: replaced); each engine owns a fixed
share. Slots: a group starts once group_size of rollout_seqs are free, graded or not the others."""
import time


class Budget:  # engine e's own starts, counted here; the trainer's discards come by the store
    def __init__(self, store, cfg, e, v0):
        self.store, self.cfg, self.e, self.v0, self.look_at = store, cfg, e, v0, 0.0
        self.started = self.returned = self.discarded = 0  # returned: flat, by the engine itself

    def take(self, version, live):  # -> how many groups start now; live: sequences running
        c, E, now = self.cfg, self.cfg["engines"], time.monotonic()
        room = (c["rollout_seqs"] - live) // c["group_size"]
        total = (version - self.v0 + c["max_staleness"] + 1) * c["batch_groups"]  # all engines'
        free = total // E + (self.e < total % E) - self.started + self.returned  # our share
        if room > 0 and free + self.discarded <= 0 and now > self.look_at:  # any discarded since?
            self.discarded, self.look_at = int(self.store.add(f"discarded{self.e}", 0)), now + 0.01
        n = max(0, min(room, free + self.discarded))
        self.started += n
        return n

