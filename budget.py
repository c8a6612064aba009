"""budget.py: when an engine may start a group. One started at version v is <= max_staleness old
when trained if <= allowed(v) = (v - v0 + max_staleness + 1) * batch_groups started since v0, net
of drops: a store count, taken by atomic adds. For RESERVE_S after loading v an engine takes only
its share of what v added, then anyone's: none holds another back.

Runs in each engine process (rollout.py); the count lives in rank 0's store, so every engine on
every node draws on the same budget without talking to the others."""
import time

RESERVE_S = 2.0  # after a load, the others' shares stay theirs
LOOK_S = 0.01  # spent: look again at most this often


class Budget:
    def __init__(self, store, cfg, e, v0):
        self.store, self.cfg, self.e, self.v0 = store, cfg, e, v0
        self.started = 0  # our starts
        self.version = None  # ours, since loaded_at
        self.loaded_at = 0.0
        self.taken = 0  # our starts since, less those given back
        self.look_at = 0.0  # no store round trip before
        store.set(f"loaded{e}", str(v0))  # our version, for the others

    def take(self, version, holding):  # -> groups to start now; holding: our slots used
        c, E = self.cfg, self.cfg["engines"]
        now = time.monotonic()
        if version != self.version:
            self.version, self.loaded_at, self.taken = version, now, 0
            self.store.set(f"loaded{self.e}", str(version))
        free = (c["rollout_seqs"] - holding) // c["group_size"]
        if free <= 0 or now < self.look_at:
            return 0
        allowed = (version - self.v0 + c["max_staleness"] + 1) * c["batch_groups"]
        n = min(free, allowed - int(self.store.add("started", 0)))  # add(key, 0) reads it
        if now - self.loaded_at < RESERVE_S and E > 1:  # our share, unless one is behind
            loaded = self.store.multi_get([f"loaded{f}" for f in range(E)])
            if min(map(int, loaded)) >= version - 1:
                new = allowed if version == self.v0 else c["batch_groups"]  # v added
                n = min(n, new // E + (1 if self.e < new % E else 0) - self.taken)
        if n <= 0:
            self.look_at = now + LOOK_S
            return 0
        # ours are the last n: those past allowed go back
        over = min(n, max(0, int(self.store.add("started", n)) - allowed))
        if over:
            self.store.add("started", -over)
        n -= over
        self.started += n
        self.taken += n
        return n

    def give_back(self):  # a flat group of ours: skipped, another may start
        self.store.add("started", -1)
        self.taken -= 1
