"""budget.py: when engine e may start a group.

Staleness. Batch k trains at version k. A group started while the engine holds version v is at
most max_staleness versions old when trained if no more than

    allowed(v) = (v - v0 + max_staleness + 1) * batch_groups

groups have started since v0 (the run's first version), net of those given back: stale groups
the trainer dropped, flat ones the engines dropped (both are replaced). All engines count their
starts in one number in the store, `started`, each taking starts with an atomic add and giving
back at once any that went past allowed(v): the bound is exact, whatever the engines' speeds.

Fairness. Each engine has a reservation, its equal share of allowed(v). For RESERVE_S after it
loads a version, an engine takes only what leaves every other engine its unused share; after
that, a share still unused is anyone's. Equal engines share fairly from the first step, and an
engine that is slow, full or stopped does not hold the others back.

Slots. A group starts once group_size of the engine's rollout_seqs slots are free.
"""
import time

RESERVE_S = 2.0  # how long another engine's unused share stays its own after a load
LOOK_S = 0.01  # with the budget spent, look again at most this often (a store round trip)


def share(allowed, engines, e):  # engine e's equal part of `allowed`; engines 0.. take the rest
    return allowed // engines + (1 if e < allowed % engines else 0)


class Budget:
    def __init__(self, store, cfg, e, v0):
        self.store = store
        self.cfg = cfg
        self.e = e
        self.v0 = v0
        self.started = 0  # groups this engine started, for its messages
        self.version = None  # the version it holds, and since when
        self.loaded_at = 0.0
        self.look_at = 0.0  # no store round trip before then

    def allowed(self, version):
        c = self.cfg
        return (version - self.v0 + c["max_staleness"] + 1) * c["batch_groups"]

    def take(self, version, holding):
        """-> how many groups start now. holding: the slots this engine's sequences hold."""
        c, now = self.cfg, time.monotonic()
        free_groups = (c["rollout_seqs"] - holding) // c["group_size"]
        if version != self.version:
            self.version, self.loaded_at = version, now
        if free_groups <= 0 or now < self.look_at:
            return 0
        allowed = self.allowed(version)
        reserved = 0  # the other engines' unused shares, while they are still theirs
        if now - self.loaded_at < RESERVE_S and c["engines"] > 1:
            others = [f for f in range(c["engines"]) if f != self.e]
            nets = self.store.multi_get([f"started{f}" for f in others])
            reserved = sum(max(0, share(allowed, c["engines"], f) - int(n or 0))
                           for f, n in zip(others, nets))
        total = int(self.store.add("started", 0))  # add(key, 0) reads it
        n = min(free_groups, allowed - total - reserved)
        if n <= 0:
            self.look_at = now + LOOK_S
            return 0
        over = max(0, int(self.store.add("started", n)) - allowed)  # another engine was quicker
        if over:
            self.store.add("started", -over)
            n -= over
        if n > 0:
            self.store.add(f"started{self.e}", n)
            self.started += n
        return max(n, 0)


def give_back(store, e):  # engine e's group was dropped (flat, or stale): it may be replaced
    store.add("started", -1)
    store.add(f"started{e}", -1)
