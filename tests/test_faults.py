"""What a user sees when a run of the real thing goes wrong, and that it ends cleanly: a stop
request or a signal (even mid-push), a run that cannot learn, a dead, hung or stopped peer on this
node or another, a NaN gradient, a broken environment."""
import json
import math
import signal
import subprocess
import time

import psutil
import pytest
import torch

from conftest import ROOT
from e2e import SYNC, command, hook, kill_mid_run, metrics, ours, start, train


def test_a_broken_environment_stops_the_run_at_once(tiny, tmp_path):
    """Every real step raises: the engine stops after the first groups' answers, printing the
    traceback and the class, and the trainer names the engine's exit; nothing is left running."""
    t0 = time.time()
    p = subprocess.run(command(tmp_path, "--task=env:tests/toy_envs.py:Broken", "--max_turns=2",
                               "--eval_every=0"), cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode != 0 and time.time() - t0 < 90, p.stderr[-3000:]
    assert "the first 8 answers all failed, the environment is broken" in p.stderr
    assert "RuntimeError: broken on purpose" in p.stderr and "toy_envs.py" in p.stderr
    assert not (tmp_path / "ckpt.pt").exists() and not ours(tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_within_seconds_with_a_checkpoint(tiny, tmp_path, sig):
    # asynchronous; checkpoints only on the way out
    p = start(tmp_path, "--eval_every=0", "--ckpt_every=1000")
    t0 = time.time()
    p.send_signal(sig)  # what Ctrl-C or a scheduler's kill does to torchrun
    _, err = p.communicate(timeout=60)
    took = time.time() - t0
    print(f"\n{sig.name} to torchrun: everything gone {took:.1f} s later, checkpoint written")
    assert p.returncode != 0 and took < 20, (took, err[-3000:])
    assert f"stopped at step {len(metrics(tmp_path)[0])}: {sig.name}; checkpoint" in err, err
    assert "continue with --resume" in err
    assert "terminate called" not in err, err[-3000:]  # no abort on the way out
    assert not ours(tmp_path)
    done, _ = metrics(tmp_path)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["version"] == len(done)
    # resume the asynchronous run: nothing trained twice, nothing before the mark skipped
    if sig == signal.SIGTERM:
        steps, _, _ = train(tmp_path, "--eval_every=0", f"--max_steps={len(done) + 3}", "--resume")
        trained = [p for m in steps for p in m["prompts"]]
        assert [m["version"] for m in steps] == list(range(1, len(done) + 4))
        assert len(trained) == len(set(trained)) == 4 * len(steps)
        # only stale drops are missing
        assert len(set(range(ckpt["next"])) - set(trained)) <= ckpt["dropped"][0]  # [stale, flat]


def test_a_signal_during_a_push_stops_every_rank_at_the_step_boundary(tiny, tmp_path):
    """Ctrl-C while rank 0 pushes the weights of version 2: both ranks finish the push, stop at the
    next step boundary, and the checkpoint the message names is there."""
    env = hook(tmp_path, "signal_in_push")
    p = subprocess.run(command(tmp_path / "run", "--eval_every=0", "--ckpt_every=1000", nproc=2),
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode != 0 and not ours(tmp_path)
    assert "stopped at step 2: SIGINT; checkpoint at version 2" in p.stderr, p.stderr[-3000:]
    assert 'train.py", line' not in p.stderr, p.stderr[-3000:]  # no rank raised (torchrun does)
    steps, _ = metrics(tmp_path / "run")
    assert len(steps) == 2 and torch.load(tmp_path / "run" / "ckpt.pt")["version"] == 2


def test_a_run_that_cannot_learn_says_so_and_stops(tiny, tmp_path):
    """No answer can ever be right, so every group is flat and dropped: the run says so while it
    waits, writes what the model wrote to samples.jsonl, and stops after stall_s with one line that
    says why and what to try. Two ranks, and stall_s above timeout_s: rank 1 waits for rank 0's
    batch as long as rank 0 does."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": "1234567"})
                            + "\n" for i in range(40)))
    p = subprocess.run(command(tmp_path / "run", "--task=gsm8k", f"--data_path={data}",
                               "--eval_n=5", "--eval_every=0", "--drop_flat", "--stall_s=50",
                               "--timeout_s=30", nproc=2),
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and not ours(tmp_path)
    assert "dropped since the last usable one: " in p.stdout, p.stdout
    assert "flat at reward 0" in p.stdout
    why = [line for line in p.stderr.splitlines() if line.startswith("stopped at step 0:")]
    assert len(why) == 1 and "nothing usable came in stall_s=50 s" in why[0], p.stderr[-3000:]
    assert "flat at reward 0" in why[0] and "--drop_flat=False" in why[0], why[0]
    samples = [json.loads(line) for line in open(tmp_path / "run" / "samples.jsonl")]
    assert samples and all(s["dropped"] == "flat" and s["reward"] == 0 for s in samples)


def test_a_killed_rollout_process_stops_training_quickly_and_cleanly(tiny, tmp_path):
    """... and at the step boundary where it is seen, every step trained so far is checkpointed,
    though only a stop request would checkpoint at ckpt_every=1000."""
    p = start(tmp_path, "--eval_every=0", "--timeout_s=30", "--ckpt_every=1000")
    rollout = [q for q in ours(tmp_path) if "rollout.py" in " ".join(q.cmdline())]
    assert len(rollout) == 1
    t0 = time.time()
    rollout[0].send_signal(signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    took = time.time() - t0
    print(f"\nrollout process SIGKILLed: trainer exited {took:.1f} s later")
    assert p.returncode != 0
    assert f"rollout process 0 (node 0, pid {rollout[0].pid}) exited with code -9" in err
    assert took < 20, took
    assert not ours(tmp_path)
    done, _ = metrics(tmp_path)
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["version"] == len(done)
    assert f"checkpoint at version {len(done)}, continue with --resume once the cause" in err


def test_a_killed_trainer_takes_the_rollout_process_down(tiny, tmp_path):
    p = start(tmp_path, "--eval_every=0", "--timeout_s=30")
    procs = ours(tmp_path)
    rank0 = [q for q in procs
             if "train.py" in q.cmdline() and "torch.distributed.run" not in q.cmdline()]
    rollout = [q for q in procs if "rollout.py" in " ".join(q.cmdline())]
    assert len(rank0) == 1 and len(rollout) == 1, [q.cmdline()[:3] for q in procs]
    t0 = time.time()
    rank0[0].kill()
    rollout[0].wait(timeout=30)
    took = time.time() - t0
    p.communicate(timeout=60)
    print(f"\ntrainer rank 0 SIGKILLed: rollout process gone {took:.1f} s later, "
          f"torchrun {time.time() - t0:.1f} s")
    assert p.returncode != 0 and took < 5, took  # torchrun reports the failure
    assert not ours(tmp_path)


def test_a_nan_gradient_stops_the_run_before_it_reaches_the_weights(tiny, tmp_path):
    # lr=1e30 takes one finite but absurd step; the next forward passes overflow, their
    # gradients are NaN
    p = subprocess.run(command(tmp_path, "--lr=1e30", "--eval_every=0", "--max_steps=20"),
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "FloatingPointError: step " in p.stderr and ": lower lr or check the data" in p.stderr
    steps, _ = metrics(tmp_path)
    assert 1 <= len(steps) < 20 and all(math.isfinite(m["grad_norm"]) for m in steps)
    # the last good weights are kept (ckpt_every's default is far off)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["version"] == len(steps) and all(t.isfinite().all() for t in ckpt["model"].values())
    assert not ours(tmp_path)


def test_an_engine_killed_during_a_push_ends_every_process_within_seconds(tiny, tmp_path):
    """Two ranks, two engines; engine 1 is SIGKILLed as rank 0 starts a push: rank 0 names it, and
    every process of the run is gone within 10 s (none waits on the dead engine's collective)."""
    env = dict(hook(tmp_path, "kill_in_push"), KILLED=str(tmp_path / "killed"))
    p = subprocess.Popen(command(tmp_path / "run", "--eval_every=0", "--rollout_engines=2",
                                 "--timeout_s=60", nproc=2),
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    while p.poll() is None and ours(tmp_path / "run"):
        time.sleep(0.1)
    gone = time.time()
    _, err = p.communicate(timeout=60)
    pid, killed = open(tmp_path / "killed").read().split()
    print(f"\nengine 1 SIGKILLed in a push: every process gone {gone - float(killed):.1f} s later")
    assert p.returncode != 0 and gone - float(killed) < 10, err[-3000:]
    assert f"rollout process 1 (node 0, pid {pid}) exited with code -9" in err, err[-3000:]


def test_a_quiet_engine_is_not_a_dead_one(tiny, tmp_path):
    """Every optimizer step takes 8 s, longer than timeout_s = 5: at eta = 0 the engine has nothing
    to send meanwhile. Its heartbeat says it lives: the run finishes."""
    env = hook(tmp_path, "slow_step")
    steps, _, _ = train(tmp_path / "run", *SYNC, "--max_steps=3", "--timeout_s=5", env=env)
    assert [m["t_train_s"] > 8 for m in steps] == [True] * 3


def test_a_remote_engine_killed_is_named_on_both_nodes_within_seconds(tiny, tmp_path):
    """Two nodes (torchrun agents here), one rank and one engine each; node 1's engine is
    SIGKILLed mid-run: its node names it with its pid and exit code, rank 0 by engine and node
    (its wire breaks, or its heartbeats stop), and every process of both nodes is gone within
    20 s."""
    engine, errs = kill_mid_run(tmp_path, "engine", lambda nodes: [
        q for q in ours(tmp_path) if q.cmdline()[-1] == "1" and "rollout.py" in q.cmdline()[1]])
    # rank 0 names it (by the broken wire, or its silence), and keeps the steps trained so far
    assert "rollout process 1 (node 1)" in errs[0], errs[0][-3000:]
    assert "checkpoint at version" in errs[0] and (tmp_path / "ckpt.pt").exists()
    assert f"rollout process 1 (node 1, pid {engine.pid}) exited with code -9" in errs[1]


def test_a_trainer_rank_killed_on_another_node_is_named_and_both_nodes_exit(tiny, tmp_path):
    """Two nodes; node 1's trainer rank is SIGKILLed mid-run (its torchrun takes node 1 down,
    and tells node 0 nothing): rank 0 names the rank and its node once its heartbeat stops, and
    every process of both nodes is gone within 20 s (not timeout_s = 60 later)."""
    _, errs = kill_mid_run(tmp_path, "trainer rank", lambda nodes: [
        q for q in psutil.Process(nodes[1].pid).children() if "train.py" in q.cmdline()])
    assert "trainer rank 1 (node 1) sent no heartbeat for 10 s" in errs[0], errs[0][-3000:]


def test_an_engine_stopped_half_the_time_holds_no_other_back(tiny, tmp_path):
    """Two engines, eta = 1; engine 1 is stopped (SIGSTOP) for 4 s of every 8: its heartbeat
    stops but not for DEAD_S. The run goes on through the stops, the other engine makes most of
    the trained groups (its pushes wait for no other engine, and it takes the share engine 1
    leaves), no token is more than eta versions old when trained, and it stops cleanly."""
    p = start(tmp_path, "--rollout_engines=2", "--eval_every=0", "--timeout_s=60")
    engine1 = [q for q in ours(tmp_path)
               if q.cmdline()[-1] == "1" and "rollout.py" in " ".join(q.cmdline())][0]
    before = len(metrics(tmp_path)[0])
    for stops in range(10):  # 3 stops at least; more until 6 steps (a busy machine trains slower)
        if stops >= 3 and len(metrics(tmp_path)[0]) - before >= 6:
            break
        engine1.suspend()
        time.sleep(4)
        engine1.resume()
        time.sleep(4)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    steps = metrics(tmp_path)[0][before:]
    made = [sum(m["engine_groups"][e] for m in steps) for e in (0, 1)]
    print(f"\nengine 1 stopped half the time: {len(steps)} steps, trained groups by engine {made}")
    assert "stopped at step" in err and "heartbeat" not in err, err[-3000:]
    assert len(steps) >= 6 and max(m["staleness_max"] for m in steps) <= 1, steps
    assert made[0] > sum(made) / 2, made
    assert not ours(tmp_path)


def test_an_engine_whose_loop_hangs_is_named(tiny, tmp_path):
    """The engine's loop stops moving after 200 iterations, its heartbeat thread going on: rank 0
    names it once it has not moved for timeout_s, and the run is gone soon after."""
    env = hook(tmp_path, "hang")
    t0 = time.time()
    p = subprocess.run(command(tmp_path / "run", "--eval_every=0", "--max_steps=1000",
                               "--timeout_s=8"), cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode != 0 and not ours(tmp_path)
    assert "rollout process 0 (node 0): its loop has not moved for" in p.stderr, p.stderr[-3000:]
    assert time.time() - t0 < 120
