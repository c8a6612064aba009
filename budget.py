"""budget.py: when an engine may start a group. One started at version v is <= max_staleness old
when trained if <= allowed(v) = (v - v0 + max_staleness + 1) * batch_groups started since v0, net
of drops: a store count, taken by atomic adds. For RESERVE_S after loading v an engine takes only
its share of what v added, then anyone's: none holds another back.

Runs in each engine process (rollout.py); the count lives in rank 0's store, so every engine on
every node draws on the same budget without talking to the others."""
import math, time

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
        c = self.cfg
        now = time.monotonic()
        if version != self.version:  # a load: our share of what it added is counted anew
            self.version, self.loaded_at, self.taken = version, now, 0
            self.store.set(f"loaded{self.e}", str(version))
        free = (c["rollout_seqs"] - holding) // c["group_size"]
        if free <= 0 or now < self.look_at:
            return 0
        # THE INVARIANT: groups started since v0 (every engine's, net of drops) <= allowed, so
        # each is trained by version + max_staleness at the latest: η holds by construction
        allowed = (version - self.v0 + c["max_staleness"] + 1) * c["batch_groups"]
        n = min(free, allowed - int(self.store.add("started", 0)),  # add(key, 0) reads it
                self.reserve(version, allowed, now))
        if n <= 0:
            self.look_at = now + LOOK_S
            return 0
        # another engine may take the same room at the same time: add first, then give back
        # what went past allowed (ours are the last n), so that the count never stays above it
        over = min(n, max(0, int(self.store.add("started", n)) - allowed))
        if over:
            self.store.add("started", -over)
        n -= over
        self.started += n
        self.taken += n
        return n

    def reserve(self, version, allowed, now):
        """-> the most we may start now. For RESERVE_S after loading `version`, our share of the
        groups it added (batch_groups; at v0 all allowed): the first engine to load never takes
        the room the others' loads make. Unless one of them is a version behind: its share would
        wait for it, and the batch with it."""
        E = self.cfg["engines"]
        if E == 1 or now - self.loaded_at >= RESERVE_S:
            return math.inf
        if min(map(int, self.store.multi_get([f"loaded{f}" for f in range(E)]))) < version - 1:
            return math.inf
        new = allowed if version == self.v0 else self.cfg["batch_groups"]
        return new // E + (1 if self.e < new % E else 0) - self.taken

    def give_back(self):  # a flat group of ours: skipped, another may start
        self.store.add("started", -1)
        self.taken -= 1
