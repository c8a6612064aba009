"""
buffer.py: where finished groups wait for the trainer (trainer rank 0 only).

A receiver thread put()s groups as they arrive from the rollout process; the training loop get()s a batch of exactly
`batch_groups` groups. On the way out, get() discards
  - stale groups: trained now at version v, a group whose oldest token came from version < v - max_staleness;
  - flat groups (optional): every completion got the same reward, so every advantage is 0 and the group would only
    cost compute.
Each stale discard is reported through on_discard so the rollout process can start a replacement (its admission
control counts groups the trainer has not yet accounted for). Flat groups are not reported: the rollout process graded
them itself and started their replacements the moment they finished, without waiting for the trainer to notice.

Simplifications: first in, first out; no priority, no replay, no cap on memory beyond what admission control bounds.
"""
import threading
import time


class Buffer:
    def __init__(self, max_staleness, drop_flat, on_discard=lambda n: None):
        self.groups, self.cond = [], threading.Condition()
        self.max_staleness, self.drop_flat, self.on_discard = max_staleness, drop_flat, on_discard
        self.dropped_stale = self.dropped_flat = 0
        self.error = None  # set by whoever finds the producer dead; get() raises it

    def put(self, group):
        with self.cond:
            self.groups.append(group)
            self.cond.notify()

    def fail(self, message):
        with self.cond:
            self.error = message
            self.cond.notify()

    def get(self, version, n_groups, check_alive=lambda: None):
        """Block until n_groups usable groups are in; -> (groups, every group taken out including the discarded ones,
        seconds waited). check_alive() is called about once a second while waiting and should raise if the producer
        is gone."""
        batch, seen, waited = [], [], 0.0
        while len(batch) < n_groups:
            with self.cond:
                t0 = time.perf_counter()
                while not self.groups and self.error is None:
                    self.cond.wait(timeout=1.0)
                    if not self.groups:
                        check_alive()
                waited += time.perf_counter() - t0
                if self.error is not None:
                    raise RuntimeError(self.error)
                group = self.groups.pop(0)
            seen.append(group)
            if version - group["version_min"] > self.max_staleness:
                self.dropped_stale += 1
                self.on_discard(1)
            elif self.drop_flat and is_flat(group):
                self.dropped_flat += 1
            else:
                batch.append(group)
        return batch, seen, waited


def is_flat(group):
    rewards = [c["reward"] for c in group["completions"]]
    return max(rewards) == min(rewards)


def worth_a_forward(groups, world_size, keep_flat=False):
    """The groups the trainer must run. A flat group's advantages are all 0, so (without a KL term) it adds nothing to
    the gradient, only its tokens to the token mean's denominator: skip it, except as filler so that every rank runs
    the same number of forward passes (FSDP's collectives need that)."""
    if keep_flat:
        return groups
    live, flat = [g for g in groups if not is_flat(g)], [g for g in groups if is_flat(g)]
    n = max(1, -(-len(live) // world_size)) * world_size
    return live + flat[:n - len(live)]


def split(groups, world_size):
    """Deal the batch's groups to trainer ranks: rank r gets groups r, r + W, r + 2W, ..."""
    if len(groups) % world_size:
        raise ValueError(f"{len(groups)} groups cannot be split evenly over {world_size} trainer ranks")
    return [groups[r::world_size] for r in range(world_size)]
