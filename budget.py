"""budget.py: when an engine may start a group. Batch k trains at version k, so a group started at
version v is at most max_staleness old when trained if at most allowed(v) = (v - v0 +
max_staleness + 1) * batch_groups groups started since version v0, net of those dropped. Engines
count starts in one number in the store (an atomic add) and give back at once any past allowed(v):
exact. For RESERVE_S after loading v each takes only its equal share of what v added, unless an
engine is two versions behind (stopped, or slow to load); then what the others left is anyone's:
fair from the first step, and a slow, full or stopped engine holds no other back.
"""
import time

RESERVE_S = 2.0  # after a load, how long the others' shares stay theirs
LOOK_S = 0.01  # spent: look again at most this often (a store round trip)


class Budget:
    def __init__(self, store, cfg, e, v0):
        self.store, self.cfg, self.e, self.v0 = store, cfg, e, v0
        self.started = 0  # our starts
        self.version = None  # the version we hold, since loaded_at
        self.loaded_at = 0.0
        self.taken = 0  # our starts since, less the flat ones we gave back
        self.look_at = 0.0  # no store round trip before
        store.set(f"loaded{e}", str(v0))  # the version we hold, for the others to see

    def allowed(self, version):
        c = self.cfg
        return (version - self.v0 + c["max_staleness"] + 1) * c["batch_groups"]

    def take(self, version, holding):  # -> how many groups start now; holding: our slots used
        c, E = self.cfg, self.cfg["engines"]
        now = time.monotonic()
        if version != self.version:
            self.version, self.loaded_at, self.taken = version, now, 0
            self.store.set(f"loaded{self.e}", str(version))
        free = (c["rollout_seqs"] - holding) // c["group_size"]
        if free <= 0 or now < self.look_at:
            return 0
        allowed = self.allowed(version)
        n = min(free, allowed - int(self.store.add("started", 0)))  # add(key, 0) reads it
        if now - self.loaded_at < RESERVE_S and E > 1:  # ours only, unless one is behind
            loaded = self.store.multi_get([f"loaded{f}" for f in range(E)])
            if min(map(int, loaded)) >= version - 1:  # engines 0.. take the remainder
                new = allowed - (self.allowed(version - 1) if version > self.v0 else 0)
                n = min(n, new // E + (1 if self.e < new % E else 0) - self.taken)
        if n <= 0:
            self.look_at = now + LOOK_S
            return 0
        # ours are the last n of the count: those past allowed go back (another was quicker)
        over = min(n, max(0, int(self.store.add("started", n)) - allowed))
        if over:
            self.store.add("started", -over)
        n -= over
        self.started += n
        self.taken += n
        return n

    def give_back(self):  # a flat group of ours: the trainer skips it, another may start
        give_back(self.store)
        self.taken -= 1


def give_back(store):  # a group dropped (flat, or stale): another may start
    store.add("started", -1)
