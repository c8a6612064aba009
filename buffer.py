"""buffer.py: rank 0 holds the engines' groups, FIFO, dropping the too stale and (drop_flat) the
flat; deal() splits a batch over ranks. No priority, no replay, no memory cap.

Runs on trainer rank 0: a receiving thread per engine put()s groups as they arrive, and the main
loop get()s a batch at each step boundary. Other ranks get their share by broadcast."""
import threading, time
from collections import Counter

from loss import tokens
from reward import is_flat


class Stopped(Exception):
    """Ctrl-C, SIGTERM (to every rank), a stall: stop at the step boundary."""


class Buffer:
    def __init__(self, max_staleness, drop_flat, on_discard=lambda group: None, stall_s=0):
        self.max_staleness = max_staleness
        self.drop_flat = drop_flat
        self.on_discard = on_discard  # a stale group's start back (budget.py)
        self.stall_s = stall_s  # > 0: this long with nothing usable: stop
        self.groups = []  # as they came; an exception: its sender died
        self.cond = threading.Condition()
        self.dropped = {"stale": 0, "flat": 0}  # over the run

    def put(self, group):
        with self.cond:
            self.groups.append(group)
            self.cond.notify()

    def get(self, version, n_groups, check_alive=lambda: None, report=lambda text, groups: None):
        """-> (n_groups usable, every group taken out, seconds waited). The rule, one group at a
        time in arrival order: too stale to train at `version`, or flat (drop_flat), it is dropped
        (a stale one's start goes back to its engine's budget); else it joins the batch."""
        check_alive()
        batch, seen, wait = [], [], Wait(version, n_groups)
        while len(batch) < n_groups:
            g = self.next(wait, len(batch), check_alive, report)
            if isinstance(g, Exception):  # its receiving thread's: the engine is lost
                raise g
            seen.append(g)
            stale = version - g["version_min"] > self.max_staleness
            flat = self.drop_flat and is_flat(g)
            if stale and not flat:  # (a flat one's was given back as it was made)
                self.on_discard(g)
            if stale or flat:
                why = "stale" if stale else "flat"
                self.dropped[why] += 1
                wait.dropped.append(dict(g, dropped=why))
            else:
                batch.append(g)
                wait.dropped, wait.reported, wait.usable = [], 0, time.perf_counter()
        return batch, seen, time.perf_counter() - wait.start

    def next(self, wait, have, check_alive, report):
        """-> the oldest group, once there is one. Meanwhile: engines checked each second, a
        report every minute (a third of stall_s if less), Stopped after stall_s without a usable
        group."""
        with self.cond:
            while not self.groups:
                self.cond.wait(timeout=1.0)
                check_alive()
                now = time.perf_counter()
                if now - wait.told > min(60, self.stall_s / 3 or 60):
                    report(f"waiting {now - wait.start:.0f} s for batch {wait.version} ({have}/"
                           f"{wait.n_groups} groups), {describe(wait.dropped)}",
                           wait.dropped[wait.reported:])
                    wait.told, wait.reported = now, len(wait.dropped)
                if self.stall_s and now - wait.usable > self.stall_s:
                    raise Stopped(
                        f"nothing usable came in stall_s={self.stall_s} s "
                        f"({describe(wait.dropped)}); an easier task or stronger model, "
                        "--drop_flat=False, or check the grader on samples.jsonl")
            return self.groups.pop(0)


class Wait:  # one get()'s clocks and its dropped groups, for the reports and the stall
    def __init__(self, version, n_groups):
        self.version = version
        self.n_groups = n_groups
        # start: the get() began; told: the last report; usable: a usable group last came
        self.start = self.told = self.usable = time.perf_counter()
        self.dropped = []  # since the last usable one
        self.reported = 0  # of those, already in a report


def describe(dropped):  # -> "3 groups dropped since ...: 2 flat at reward 0, 1 stale"
    kinds = Counter(f"flat at reward {g['completions'][0]['reward']:g}" if g["dropped"] == "flat"
                    else g["dropped"] for g in dropped)
    listed = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    text = f"{len(dropped)} groups dropped since the last usable one"
    return f"{text}: {listed}" if kinds else text


def deal(groups, world_size):
    """-> each rank's groups: the longest first, each to the rank with the fewest tokens (a step
    lasts as its slowest rank); a flat group only fills a rank with none."""
    shares = [[] for _ in range(world_size)]
    for g in sorted([g for g in groups if not is_flat(g)], key=tokens, reverse=True):
        min(shares, key=lambda share: sum(map(tokens, share))).append(g)  # the first lightest
    filler = [g for g in groups if is_flat(g)]
    for share in shares:
        if not share:
            share.append(filler.pop(0))
    return shares
