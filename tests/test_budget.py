"""The staleness budget (budget.py) over a real TCPStore, as engines share it: fair shares after a
load, a share left unused (or by an engine behind) taken by another engine, and never a start
past the bound, however many engines take at once."""
import random
import threading
import time

import budget
import sync
from conftest import free_port

CFG = {"rollout_seqs": 1000, "group_size": 4, "max_staleness": 1, "batch_groups": 8}


def budgets(engines):
    port = free_port()
    master = sync.open_store("127.0.0.1", port, True, 30)
    cfg = dict(CFG, engines=engines)
    return master, [budget.Budget(sync.open_store("127.0.0.1", port, False, 30), cfg, e, 0)
                    for e in range(engines)]


def test_after_a_load_each_engine_gets_its_share_then_what_is_left_is_anyones(monkeypatch):
    monkeypatch.setattr(budget, "RESERVE_S", 0.5)
    monkeypatch.setattr(budget, "LOOK_S", 0.0)
    master, (a, b) = budgets(2)
    # version 0 allows (0 + 1 + 1) * 8 = 16 starts: 8 each while the shares are reserved
    assert a.take(0, 0) == 8 and a.take(0, 0) == 0
    time.sleep(0.6)  # b never came (stopped, or full): its share is anyone's now
    assert a.take(0, 0) == 8 and a.take(0, 0) == 0 and b.take(0, 0) == 0
    a.give_back()  # one of a's groups came back flat: another may start
    # version 1 adds 8: 4 each, whatever came before; the one given back is anyone's later
    assert b.take(1, 0) == 4 and a.take(1, 0) == 4 and b.take(1, 0) == 0
    time.sleep(0.6)
    assert b.take(1, 0) == 1 and a.take(1, 0) == 0
    assert int(master.add("started", 0)) == 24 == a.started - 1 + b.started


def test_an_engine_two_versions_behind_reserves_nothing(monkeypatch):
    """b stopped at version 0 (its pushes are late): a, at version 2, may take b's share too;
    b, back at version 3, takes its share of what 3 added, not what it missed."""
    monkeypatch.setattr(budget, "LOOK_S", 0.0)
    master, (a, b) = budgets(2)
    assert a.take(0, 0) == 8 and a.take(1, 0) == 4  # b at 0 is one behind: half of 16, of 8
    assert a.take(2, 0) == 20 and b.take(0, 0) == 0  # two behind: all 32 are anyone's
    assert b.take(3, 0) == 4 and a.take(3, 0) == 4  # b caught up: 40, half of 8 each


def test_free_slots_bound_the_starts():
    _, (a,) = budgets(1)
    assert a.take(0, 1000 - 3 * 4) == 3  # room for 3 groups of 4


def test_many_engines_at_once_never_start_past_the_bound(monkeypatch):
    """Four engines in threads take as fast as they can, each with a random number of free
    slots: at each version all of allowed(v) is started, and not one start more."""
    monkeypatch.setattr(budget, "LOOK_S", 0.0)
    monkeypatch.setattr(budget, "RESERVE_S", 0.0)
    master, engines = budgets(4)
    for v in range(5):
        kept = [0] * 4

        def run(e):
            for _ in range(100):
                kept[e] += engines[e].take(v, random.choice([0, 992, 996]))
        threads = [threading.Thread(target=run, args=(e,)) for e in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        total = sum(e.started for e in engines)
        assert total == int(master.add("started", 0)) == (v + 2) * 8, (v, kept, total)
