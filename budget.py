"""budget.py: when an engine may start a group, in one place. Two limits:
- staleness: batch k trains at version k, so a group started at version v is at most max_staleness
  versions old then iff at most (v - v0 + max_staleness + 1) * batch_groups groups have started
  since v0, net of those discarded (flat or stale: a replacement starts). Each engine owns a fixed
  share of that budget: none waits for tickets while another holds more than its share, and who
  asks first after a load does not matter.
- slots: an engine runs at most rollout_seqs sequences; a group starts once group_size of them are
  free, whether or not its earlier groups are graded (a group's answers end at different times).
Its engine's own starts are counted here; the trainer's discards come through the store."""


def share(total, engines, e):  # engine e's part of `total`: equal, the first total % engines +1
    return total // engines + (e < total % engines)


class Budget:
    def __init__(self, store, cfg, e, v0):
        self.store, self.cfg, self.e, self.v0 = store, cfg, e, v0
        self.started = self.returned = self.discarded = 0  # returned: by the engine (flat)

    def tickets(self, version):  # -> how many more groups engine e may start at `version`
        total = (version - self.v0 + self.cfg["max_staleness"] + 1) * self.cfg["batch_groups"]
        free = share(total, self.cfg["engines"], self.e) - self.started + self.returned
        if free + self.discarded <= 0:  # the trainer may have discarded some since we looked
            self.discarded = int(self.store.add(f"discarded{self.e}", 0))
        return max(0, free + self.discarded)

    def groups_room(self, live):  # -> how many groups fit in the free sequence slots
        return (self.cfg["rollout_seqs"] - live) // self.cfg["group_size"]


def discard(store, group):  # the trainer's end: a stale group's ticket back to its engine
    store.add(f"discarded{group['engine']}", 1)


def check(cfg, engines):  # -> a warning if the budget cannot fill the engines' slots, else None
    G, E, S = cfg["group_size"], engines, cfg["rollout_seqs"]
    total = (cfg["max_staleness"] + 1) * cfg["batch_groups"]
    if total * G < E * S:
        return (f"the staleness budget, (max_staleness + 1) x batch_groups = {total} groups of "
                f"{G}, fills {total * G} of the {E} engines' {E} x rollout_seqs = {E * S} "
                f"sequence slots: raise batch_groups or max_staleness, or use fewer engines or "
                f"rollout_seqs={total * G // E}")
