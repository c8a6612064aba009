import threading
import time

import pytest

from buffer import Buffer, Stopped, deal, is_flat


def group(version_min, rewards=(1.0, 0.0)):
    return {"version_min": version_min, "completions": [{"reward": r} for r in rewards]}


def test_stale_groups_are_dropped_counted_and_reported():
    discards = []
    b = Buffer(max_staleness=1, drop_flat=False, on_discard=discards.append)
    for v in (3, 4, 5, 2):
        b.put(group(v))
    batch, seen, _ = b.get(version=5, n_groups=2)
    # 3 is 2 versions old at version 5: dropped
    assert [g["version_min"] for g in batch] == [4, 5] and len(seen) == 3
    assert b.dropped["stale"] == 1 and [g["version_min"] for g in discards] == [3]


def test_a_flat_stale_group_gives_its_ticket_back_once():
    """Its engine gave a flat group's ticket back when it sent it; stale too, the buffer must
    not give it back again (one more group would start past the staleness bound)."""
    for drop_flat, want in ((True, 0), (False, 1)):
        discards = []
        b = Buffer(max_staleness=0, drop_flat=drop_flat, on_discard=discards.append)
        b.put(group(0, (1.0, 1.0)))
        b.put(group(1))
        b.get(version=1, n_groups=1)
        assert b.dropped["stale"] == 1 and len(discards) == want, drop_flat


def test_flat_groups_are_dropped_only_when_asked():
    flat = group(0, (1.0, 1.0, 1.0))
    assert is_flat(flat) and not is_flat(group(0))
    discards = []
    b = Buffer(max_staleness=0, drop_flat=True, on_discard=discards.append)
    for g in (flat, group(0), group(0, (0.0, 0.0))):
        b.put(g)
    b.put(group(0))
    batch, _, _ = b.get(version=0, n_groups=2)
    assert len(batch) == 2 and not any(is_flat(g) for g in batch)
    assert b.dropped["flat"] == 2 and discards == []  # the rollout process counted them itself
    keep = Buffer(max_staleness=0, drop_flat=False)
    keep.put(flat)
    assert keep.get(0, 1)[0] == [flat]


def test_get_waits_for_the_producer_and_counts_the_wait():
    b = Buffer(max_staleness=0, drop_flat=False)
    threading.Timer(0.3, b.put, args=(group(0),)).start()
    batch, _, waited = b.get(0, 1)
    assert len(batch) == 1 and waited >= 0.25


def test_a_dead_producer_ends_the_wait():
    b = Buffer(max_staleness=0, drop_flat=False)
    threading.Timer(0.2, b.put, args=(RuntimeError("lost the rollout process: boom"),)).start()
    with pytest.raises(RuntimeError, match="boom"):
        b.get(0, 1)

    def dead():
        raise RuntimeError("rollout exited with code -9")
    t0 = time.time()
    with pytest.raises(RuntimeError, match="code -9"):
        Buffer(0, False).get(0, 1, check_alive=dead)
    assert time.time() - t0 < 5


def test_a_wait_with_nothing_usable_reports_then_stops():
    """Only flat groups (and one stale) come: a report every stall_s / 3 with the groups dropped
    since the last one, then Stopped after stall_s; a usable group resets the clock."""
    b, reports = Buffer(max_staleness=0, drop_flat=True, stall_s=3), []

    def produce():
        for k in range(10):
            b.put(group(-1 if k == 0 else 0, (0.0, 0.0)))
            time.sleep(0.2)
    threading.Thread(target=produce, daemon=True).start()
    t0 = time.time()
    with pytest.raises(Stopped, match=r"stall_s=3 s \(10 groups dropped since the last usable one: "
                                      r"9 flat at reward 0, 1 stale\)"):
        b.get(0, 1, report=lambda text, groups: reports.append((text, groups)))
    assert 3 <= time.time() - t0 < 6
    assert len(reports) >= 2 and "(0/1 groups)" in reports[0][0]
    assert [g["dropped"] for _, gs in reports for g in gs][:2] == ["stale", "flat"]
    b.put(group(0))  # usable: the clock starts again
    assert len(b.get(0, 1)[0]) == 1
    threading.Timer(2.0, b.put, args=(group(0),)).start()  # 2 s more of waiting: under stall_s
    assert len(b.get(0, 1)[0]) == 1


def test_a_wait_reports_only_what_was_dropped_since_the_last_usable_group():
    """Groups dropped before a usable one are not reported again in a later wait (nor kept)."""
    b, reports = Buffer(max_staleness=0, drop_flat=True, stall_s=1.5), []
    for g in (group(0, (0.0, 0.0)), group(0, (0.0, 0.0)), group(0)):  # 2 flat, then usable
        b.put(g)
    assert len(b.get(0, 1)[0]) == 1
    b.put(group(0, (1.0, 1.0)))  # 1 flat, then nothing
    with pytest.raises(Stopped, match=r"1 groups dropped since the last usable one: 1 flat at "
                                      r"reward 1\)"):
        b.get(0, 1, report=lambda text, groups: reports.append((text, groups)))
    assert reports and [len(gs) for _, gs in reports] == [1] + [0] * (len(reports) - 1)


def test_ranks_get_equal_tokens_and_flat_groups_only_as_filler():
    def sized(n, rewards=(1.0, 0.0)):  # a group of n packed tokens: a prompt of n - 2, two answers
        return {"version_min": 0, "prompt_ids": [1] * (n - 2),
                "completions": [{"ids": [1, 2], "reward": r} for r in rewards]}
    live = [sized(10), sized(40), sized(25), sized(20)]
    flat = [sized(30, (1.0, 1.0)), sized(30, (0.0, 0.0))]
    batch = [flat[0], *live[:2], flat[1], *live[2:]]
    assert deal(batch, 1) == [[live[1], live[2], live[3], live[0]]]  # flat groups: no forward
    # the longest first, each to the rank with the fewest tokens: 40 + 10 and 25 + 20
    assert deal(batch, 2) == [[live[1], live[0]], [live[2], live[3]]]
    # a rank that would have none runs a flat group (zero gradient): FSDP needs every rank
    assert deal(batch, 5) == [[live[1]], [live[2]], [live[3]], [live[0]], [flat[0]]]
    assert deal(flat, 1) == [flat[:1]]  # an all-flat batch still steps
