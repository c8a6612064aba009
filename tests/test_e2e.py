"""The real thing on the tiny model: torchrun, trainer ranks, one vLLM rollout process, the process
groups between them. Also what a user sees when things go wrong: config errors before anything
starts, a dead peer, a signal, a checkpoint and an exact resume."""
import glob
import json
import math
import os
import re
import signal
import sqlite3
import struct
import subprocess
import sys
import time

import psutil
import pytest
import torch

from conftest import ROOT, free_port

KEYS = ("step version reward_mean response_len_mean staleness_mean staleness_max "
        "dropped_stale dropped_flat loss bounded_frac_stale "
        "cut_frac logprob_mismatch logprob_shift_reloaded grad_norm samples "
        "gen_tokens t_wait_s t_train_s t_sync_s elapsed_s borrowed_frac engine_groups "
        "turns_mean rollout_running_frac rollout_pause_s "
        "reward_failed rollout_grade_s").split()
SYNC = ("--max_staleness=0", "--eval_every=0")


def command(out, *overrides, nproc=1):
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}", "train.py", "config/tiny.py", f"--out_dir={out}",
            f"--rollout_port={free_port()}", *overrides]


def ours(out):
    """Every process of the run writing to `out` (torchrun, trainer ranks, the rollout process)
    still alive."""
    return [q for q in psutil.process_iter(["cmdline"])
            if str(out) in " ".join(q.info["cmdline"] or [])]


def metrics(out):
    lines = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [m for m in lines if "loss" in m], [m for m in lines if "eval_accuracy" in m]


def train(out, *overrides, nproc=1, env=None):
    p = subprocess.run(command(out, *overrides, nproc=nproc), cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=env)
    assert not ours(out), "processes left behind"
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return (*metrics(out), p)


def start(out, *overrides, steps=2):
    """Launch a long run in the background and return it once `steps` optimizer steps are logged."""
    p = subprocess.Popen(command(out, "--max_steps=1000", *overrides), cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and p.poll() is None:
        if ((out / "metrics.jsonl").exists()
                and (out / "metrics.jsonl").read_text().count("\n") >= steps):
            return p
        time.sleep(0.2)
    raise AssertionError(f"no {steps} steps within 180 s: " + p.communicate()[1][-3000:])


@pytest.fixture(scope="module")
def sync_run(tiny, tmp_path_factory):
    """One synchronous 1-rank run, the reference for the 2-rank run and for the kill-and-resume
    run."""
    out = tmp_path_factory.mktemp("sync")
    # vLLM on core 1, lent while it waits
    steps, _, _ = train(out, *SYNC, "--max_steps=6", "--rollout_cpus=1")
    return out, steps


@pytest.mark.parametrize("nproc, eta", [(1, 1), (2, 2)])
def test_async_run(tiny, tmp_path, nproc, eta):
    steps, evals, _ = train(tmp_path, f"--max_staleness={eta}", "--max_steps=6",
                            nproc=nproc)
    assert [m["version"] for m in steps] == [1, 2, 3, 4, 5, 6]
    for m in steps:
        assert all(k in m for k in KEYS), set(KEYS) - set(m)
        assert m["staleness_max"] <= eta
        assert 0 < (m["rollout_running_frac"] or 1) <= 1 and m["rollout_pause_s"] >= 0
    assert steps[-1]["samples"] == 6 * 4 * 4 and steps[-1]["gen_tokens"] > 0
    # the rollout really ran ahead of the trainer; its slots' share and its loads' pauses are seen
    assert max(m["staleness_max"] for m in steps) >= 1
    assert max(m["rollout_running_frac"] or 0 for m in steps) > 0
    assert max(m["rollout_pause_s"] for m in steps) > 0
    # completions that the trained weights computed entirely match the trainer (fp32), loads or not
    whole = [m["logprob_mismatch"] for m in steps if m["logprob_mismatch"] is not None]
    assert whole and max(whole) < 1e-4, whole
    assert [e["version"] for e in evals] == [0, 3, 6] and all(e["eval_n"] == 20 for e in evals)
    trained = [p for m in steps for p in m["prompts"]]
    assert len(trained) == len(set(trained)) == 6 * 4  # no prompt trained twice
    config = json.load(open(tmp_path / "train_config.json"))
    assert config["max_staleness"] == eta and config["max_steps"] == 6
    samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert (len(samples) == 6 * 4
            and {"prompt", "completion", "reward", "versions"} <= set(samples[0]))
    assert samples[0]["prompt"].startswith("What is ") and samples[-1]["step"] == 5
    from transformers import AutoModelForCausalLM
    # the final model, in Hugging Face format
    trained = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert trained.config.vocab_size == 512


SLOW_GRADER = """import functools, time, reward
slow = reward.grade_number
reward.grade_number = functools.wraps(slow)(
    lambda text, answer: time.sleep(0.05) or slow(text, answer))
"""


def test_an_environment_keeps_its_state_across_turns_and_trains_on_the_models_tokens(tiny,
                                                                                    tmp_path):
    """tests/toy_envs.py's Counter, η = 0 in fp32: each answer's replies count 1, 2, 3 (its own
    object served all its turns, and no other answer's); the behaviour logprobs of the model's
    tokens, over all turns, equal the trainer's; the replies' tokens are counted apart; steps that
    raise or hang past reward_timeout_s end their answer alone, counted by kind, the first of
    each shown once; held-out seeds are never trained on; no process is left behind."""
    env = dict(os.environ, TOOL_MISBEHAVES="1")
    steps, evals, p = train(tmp_path / "run", *SYNC, "--max_steps=4", "--max_turns=3",
                            "--reward_timeout_s=2", "--task=env:tests/toy_envs.py:Counter",
                            "--eval_every=4", env=env)
    for m in steps:
        assert m["logprob_mismatch"] < 1e-5 and m["staleness_max"] == 0, m
        assert 1 <= m["turns_mean"] <= 3, m
    assert max(m["turns_mean"] for m in steps) > 1.2, steps  # 0.2 replies per answer
    assert 0 < max(m["env_token_frac"] for m in steps) < 0.5
    assert steps[-1]["env_errors"] > 0 and steps[-1]["env_timeouts"] > 0, steps[-1]
    assert p.stderr.count("an environment call failed (error;") == 1, p.stderr[-3000:]
    assert p.stderr.count("an environment call failed (timeout;") == 1, p.stderr[-3000:]
    assert [e["version"] for e in evals] == [0, 4] and all(e["eval_n"] == 20 for e in evals)
    dialogues = [json.loads(line)["completion"] for line in open(tmp_path / "run/samples.jsonl")]
    counts = [[int(n) for n in re.findall(r" <reply (\d+)>", d)] for d in dialogues]
    assert any(counts) and all(c == list(range(1, len(c) + 1)) for c in counts), counts
    # training seeds come from the run's stream, never from the eval's 0..eval_n-1
    import env as env_mod
    seeds = [int(json.loads(line)["prompt"].split()[2])
             for line in open(tmp_path / "run/samples.jsonl")]
    assert seeds and min(seeds) >= env_mod.EVAL_SEEDS, seeds


def test_a_gymnasium_style_environment_runs_unchanged(tiny, tmp_path):
    steps, _, _ = train(tmp_path / "run", *SYNC, "--max_steps=2", "--max_turns=3",
                        "--task=env:tests/toy_envs.py:GymCounter", "--eval_every=0")
    assert max(m["turns_mean"] for m in steps) > 1 and steps[-1]["env_errors"] == 0, steps


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


def test_a_slow_grader_does_not_stall_the_engine(tiny, tmp_path):
    """Every answer takes 50 ms to grade (a sitecustomize module slows the grader in every process
    of the run): the engine loop spends under 10% of its stepping time on grades, where waiting for
    each one would take more time than stepping (the loop makes a batch's 16 answers in a few
    steps of a few ms)."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(SLOW_GRADER)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'hook'}{os.pathsep}{ROOT}")
    steps, _, _ = train(tmp_path / "run", "--max_steps=3", env=env)
    m = steps[-1]
    assert m["reward_failed"] == 0 and m["rollout_tokens"] > 0
    assert m["rollout_grade_s"] < 0.1 * m["rollout_engine_s"], m


def test_synchronous_run_is_on_policy(sync_run):
    _, steps = sync_run
    assert len(steps) == 6
    for k, m in enumerate(steps):
        assert m["staleness_max"] == 0 and m["logprob_shift_reloaded"] is None
        # batch k = the stream's k-th four prompts
        assert m["prompts"] == [4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3]
        # every token was sampled by the weights being trained: after 5 weight pushes the
        # trainer's logprobs still equal vLLM's (fp32), so the sync and the sampled-distribution
        # logprobs are both right
        assert m["logprob_mismatch"] < 1e-4
        assert m["turns_mean"] == 1 and m["env_token_frac"] == 0
        # vLLM generated this whole batch and said it waits for the weights being trained:
        # its core was lent
        assert m["borrowed_frac"] == 1.0
    assert steps[-1]["grad_norm"] > 0


def test_two_ranks_train_exactly_like_one(sync_run, tmp_path):
    """FSDP2 over 2 gloo ranks, each with half of every batch and with activation checkpointing,
    ends at the weights of the plain 1-rank run: the sharded gradient math (token normalisation
    across ranks, FSDP's gradient averaging) and the recomputation are right."""
    from transformers import AutoModelForCausalLM
    one_dir, one = sync_run
    two, _, _ = train(tmp_path, *SYNC, "--max_steps=6", "--activation_checkpointing", nproc=2)
    assert [m["prompts"] for m in two] == [m["prompts"] for m in one]
    # the same samples: same weights in vLLM
    assert [m["gen_tokens"] for m in two] == [m["gen_tokens"] for m in one]
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], rel=1e-4, abs=1e-6)
    a, b = (AutoModelForCausalLM.from_pretrained(one_dir),
            AutoModelForCausalLM.from_pretrained(tmp_path))
    init = AutoModelForCausalLM.from_pretrained(ROOT + "/data/tiny")
    moved = max((p - q).abs().max().item() for p, q in zip(a.parameters(), init.parameters()))
    diff = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    assert moved > 1e-3 and diff < 1e-5, (moved, diff)


@pytest.mark.parametrize("extra", [("--rollout_engines=2",), ("--colocate",),
                                   ("--stage_weights=False",)])
def test_every_engine_samples_what_the_trainer_computes(tiny, tmp_path, extra):
    """Two engines fed by one broadcast, one engine fed through shared memory, or one that
    receives each push paused, bucket by bucket (no staging copy): after every push each
    engine's logprobs of its fresh tokens equal the trainer's (fp32); with two engines each
    generates its half of every batch, from the first (each has its half reserved)."""
    steps, _, _ = train(tmp_path, *SYNC, "--max_steps=6", *extra)
    assert [m["version"] for m in steps] == [1, 2, 3, 4, 5, 6]
    for m in steps:
        assert m["staleness_max"] == 0 and m["logprob_mismatch"] < 1e-4
        assert m["engine_groups"] == ([2, 2] if extra[0].endswith("2") else [4]), steps


def test_kill_9_then_resume_trains_every_prompt_once(sync_run, tmp_path):
    """Everything is SIGKILLed mid-run; --resume continues from the last checkpoint and, step for
    step, trains the very prompts the uninterrupted run trained. Groups generated after the
    checkpoint are simply generated again."""
    p = start(tmp_path, *SYNC, "--ckpt_every=2", steps=4)
    for q in ours(tmp_path):
        try:
            q.kill()
        except psutil.NoSuchProcess:  # the rollout process may already have died with rank 0
            pass
    p.wait(timeout=30)
    # whole, even if the kill hit a write (ckpt.pt.tmp)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["version"] >= 2 and ckpt["version"] % 2 == 0
    steps, _, out = train(tmp_path, *SYNC, "--max_steps=6", "--ckpt_every=2", "--resume")
    # the log was cut back to the checkpoint
    assert [m["version"] for m in steps] == [1, 2, 3, 4, 5, 6]
    assert [m["prompts"] for m in steps] == [m["prompts"] for m in sync_run[1]]
    assert steps[-1]["samples"] == 6 * 4 * 4


def test_resume_at_an_eval_version_evaluates_it_once(tiny, tmp_path):
    """A run resumed at a version that is due an eval (here 2, with eval_every=2): the engine
    evaluates it once, after loading the checkpointed weights, and goes on."""
    train(tmp_path, "--max_steps=2", "--eval_every=2", "--ckpt_every=2")
    steps, evals, _ = train(tmp_path, "--max_steps=4", "--eval_every=2", "--ckpt_every=2",
                            "--resume")
    assert [m["version"] for m in steps] == [1, 2, 3, 4]
    assert [e["version"] for e in evals] == [0, 2, 4]


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


SIGNAL_IN_PUSH = """import os, signal, sys, time
if sys.argv[0].endswith("train.py"):
    import sync
    push, pushes = sync.push, []
    def push_after_a_signal(sender, *args, **kw):
        pushes.append(sender)
        if sender is not None and len(pushes) == 2:  # rank 0's second push (version 2)
            os.kill(os.getppid(), signal.SIGINT)  # Ctrl-C: torchrun passes it to every rank
            time.sleep(2)  # it has arrived: this push must still finish on every rank
        return push(sender, *args, **kw)
    sync.push = push_after_a_signal
"""


def test_a_signal_during_a_push_stops_every_rank_at_the_step_boundary(tiny, tmp_path):
    """Ctrl-C while rank 0 pushes the weights of version 2: both ranks finish the push, stop at the
    next step boundary, and the checkpoint the message names is there."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(SIGNAL_IN_PUSH)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'hook'}{os.pathsep}{ROOT}")
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


def two_nodes(out, *overrides):
    """Two torchrun agents on this machine as two nodes (static rendezvous), one trainer rank and
    one engine each."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
              "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    run = ["train.py", "config/tiny.py", f"--out_dir={out}", f"--rollout_port={free_port()}",
           *overrides]
    return [subprocess.Popen(launch + [f"--node_rank={n}"] + run, cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in (0, 1)]


@pytest.mark.parametrize("run", [1, 2])
def test_two_nodes_each_start_their_own_engine_and_end_cleanly(tiny, tmp_path, run):
    """Node 1's engine reaches the store on the master address, gets every push from the one
    broadcast, and sends its groups to trainer rank 0; every engine samples what the trainer
    computes; and the run ends with exit code 0 on both nodes, every time (run 1 and 2): no
    heartbeat takes rank 0's store closing at the end for a dead peer."""
    nodes = two_nodes(tmp_path, *SYNC, "--max_steps=6")
    outs = [p.communicate(timeout=600) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [err[-3000:] for _, err in outs]
    assert not ours(tmp_path)
    steps, _ = metrics(tmp_path)
    assert [m["version"] for m in steps] == [1, 2, 3, 4, 5, 6]
    for m in steps:  # each engine its half of every batch, from the first
        assert m["staleness_max"] == 0 and m["logprob_mismatch"] < 1e-4
        assert m["engine_groups"] == [2, 2], steps


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


def test_fp16_scales_its_loss_and_skips_a_step_that_overflows(tiny, tmp_path):
    """fp16 on both sides (8x less mismatch than bf16 on SmolLM2: results log): the loss is
    scaled up so that small gradients survive fp16's range; a step whose scaled gradients
    overflow is skipped, the weights untouched, and the scale halved."""
    from safetensors.torch import load_file
    # 12 steps of 32 answers: a random model's rare reward gives some of them a gradient
    fp16 = ("--rollout_dtype=float16", "--trainer_dtype=float16", *SYNC, "--max_steps=12",
            "--group_size=8")
    steps, _, _ = train(tmp_path / "ok", *fp16)
    assert all(m["loss_scale"] == 2**16 and math.isfinite(m["grad_norm"]) for m in steps)
    assert max(m["grad_norm"] for m in steps) > 0, steps
    assert max(m["logprob_mismatch"] for m in steps) < 1e-3, steps
    over = tmp_path / "over"
    steps, _, _ = train(over, *fp16, "--loss_scale=1e12", "--ckpt_every=12")
    scale = 1e12
    for m in steps:  # halved after a step that overflowed, and only then
        scale /= 1 if math.isfinite(m["grad_norm"]) else 2
        assert m["loss_scale"] == scale, steps
    assert scale < 1e12, steps
    before, after = (load_file(f"{d}/model.safetensors") for d in (tiny["tied"], over))
    assert all(torch.equal(before[k], after[k]) for k in before)
    # resumed: fp16 goes on at the scale it had reached; fp32 has none; fp16 after fp32 starts
    # at --loss_scale again
    for n, dtype, want in ((13, "float16", (scale, scale / 2)), (14, "float32", (1,)),
                           (15, "float16", (2**16, 2**15))):
        steps, _, _ = train(over, *fp16, f"--max_steps={n}", "--ckpt_every=1", "--resume",
                            f"--rollout_dtype={dtype}", f"--trainer_dtype={dtype}")
        assert [m["step"] for m in steps] == list(range(n)) and steps[-1]["loss_scale"] in want


def test_prompts_too_long_are_skipped_and_counted(tiny, tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(40)]
    rows += [{"question": "What is " + "1 + " * 100 + "1?", "answer": "101"}
             for _ in range(10)]  # > max_model_len
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps, _, _ = train(tmp_path / "out", "--task=gsm8k", f"--data_path={data}", "--eval_n=5",
                        "--eval_every=0", "--max_steps=3")
    assert len(steps) == 3 and steps[-1]["skipped_long"] > 0


def wandb_records(wandb_dir):
    """Every record of the one offline run under WANDB_DIR, read from its .wandb file as wandb's
    own protobufs. The file is a LevelDB log: a 7-byte header (":W&B", magic, version), then 32 KiB
    blocks of chunks, each with a 7-byte header (crc, length, type: 1 whole, 2 first, 3 middle,
    4 last); a block's tail shorter than a header is padding."""
    from wandb.proto.wandb_internal_pb2 import Record
    [path] = glob.glob(f"{wandb_dir}/wandb/offline-run-*/run-*.wandb")
    data, pos, chunk, records = open(path, "rb").read(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zeros: the end
            break
        chunk, pos = chunk + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            records.append(Record.FromString(chunk))
            chunk = b""
    return records


def wandb_run(wandb_dir):  # -> run name, config, logged rows (wandb's own _keys left out)
    records = wandb_records(wandb_dir)
    [run] = [r.run for r in records if r.HasField("run")]
    items = lambda update: {k: json.loads(i.value_json) for i in update
                            if not (k := i.key or "/".join(i.nested_key)).startswith("_")}
    rows = [items(r.history.item) for r in records if r.HasField("history")]
    return run.display_name, items(run.config.update), rows


def trackio_run(trackio_dir):  # -> run name, config, logged rows, from its SQLite file
    db = sqlite3.connect(f"{trackio_dir}/nanoasync.db")
    [(name, config)] = db.execute("SELECT run_name, config FROM configs").fetchall()
    rows = [{**json.loads(m), "step": step}  # trackio keeps the step in a column of its own
            for step, m in db.execute("SELECT step, metrics FROM metrics ORDER BY id")]
    config = {k: v for k, v in json.loads(config).items() if not k.startswith("_")}
    return name, config, rows


@pytest.mark.parametrize("tracker", ["wandb", "trackio"])
def test_a_tracker_gets_the_config_and_every_row(tiny, tmp_path, tracker):
    """A real tracker, offline (wandb: WANDB_MODE=offline; trackio writes locally): the run is
    named after out_dir, has the config and, in order, every row of metrics.jsonl, steps and
    evals, read back from the tracker's own files. The console shows progress and time left."""
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path),
               TRACKIO_DIR=str(tmp_path / "trackio"))
    steps, evals, p = train(tmp_path / "run-7", f"--tracker={tracker}", "--max_steps=3",
                            "--eval_every=2", env=env)
    rows = [json.loads(line) for line in open(tmp_path / "run-7/metrics.jsonl")]
    assert len(rows) == 3 + 3 and len(evals) == 3  # evals at versions 0, 2, 3
    name, config, logged = (wandb_run if tracker == "wandb" else trackio_run)(
        tmp_path if tracker == "wandb" else tmp_path / "trackio")
    assert name == "run-7" and config == json.load(open(tmp_path / "run-7/train_config.json"))
    assert config["tracker"] == tracker and logged == rows
    lines = [line for line in p.stdout.splitlines() if line.startswith("step ")]
    assert [line[:12] for line in lines] == ["step    0/3 ", "step    1/3 ", "step    2/3 "]
    assert all(" | eta " in line for line in lines) and lines[-1].endswith(" | eta 0s"), lines


def test_a_lora_run_sends_only_the_adapter_resumes_and_merges(tiny, tmp_path):
    """lora_rank=8: the trainer trains the adapter alone, each push carries it alone, and the
    engine, swapping it in place, samples what the trainer computes (fp32, eta = 0). Checkpoints
    hold the adapter and its optimizer state; a resumed run trains the same prompts. The adapter
    saved at the end loads in PEFT, and `prepare.py merge` makes a model folder of it that
    transformers and vLLM load, with the adapter's outputs."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    lora = (*SYNC, "--lora_rank=8", "--lora_alpha=16", "--lr=1e-2", "--ckpt_every=2")
    whole, _, _ = train(tmp_path / "whole", "--max_steps=6", *lora)
    adapter = load_file(tmp_path / "whole" / "adapter_model.safetensors")
    assert len(adapter) == 2 * 2 * 7 and all(".lora_" in k for k in adapter)  # A, B: 7 a layer
    for m in whole:  # only the adapter travels; the engine computes what the trainer does
        assert m["push_bytes"] == 4 * sum(t.numel() for t in adapter.values())
        assert m["staleness_max"] == 0 and m["logprob_mismatch"] < 1e-4
    assert max(t.abs().max() for k, t in adapter.items() if "lora_B" in k) > 1e-3  # B was 0
    ckpt = torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=True)
    # the adapter; of the frozen base at most the tied head's alias
    assert ckpt["version"] == 6 and {k for k in ckpt["model"] if ".lora_" not in k} <= {
        "lm_head.weight"}
    train(tmp_path / "part", "--max_steps=4", *lora)
    resumed, _, _ = train(tmp_path / "part", "--max_steps=6", *lora, "--resume")
    assert [m["prompts"] for m in resumed] == [m["prompts"] for m in whole]
    assert all(m["logprob_mismatch"] < 1e-4 for m in resumed)  # the checkpoint's adapter, sent
    subprocess.run([sys.executable, "prepare.py", "merge", str(tmp_path / "whole")], cwd=ROOT,
                   check=True, capture_output=True, timeout=300)
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        before = AutoModelForCausalLM.from_pretrained(tiny["tied"])(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny["tied"])
        want = PeftModel.from_pretrained(base, tmp_path / "whole")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "merged")(ids).logits
    assert (merged - want).abs().max() < 1e-4 and (want - before).abs().max() > 1e-3
    code = ("import sys, vllm; llm = vllm.LLM(sys.argv[1], dtype='float32', max_model_len=64, "
            "enforce_eager=True); p = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0); "
            "o = llm.generate([{'prompt_token_ids': [5, 17, 42, 99, 7]}], p, use_tqdm=False)[0]; "
            "print('logprobs', [list(d.values())[0].logprob for d in o.prompt_logprobs[1:]])")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "whole" / "merged")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    lps = torch.log_softmax(merged[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
    got = next(line for line in p.stdout.splitlines() if line.startswith("logprobs"))
    assert torch.allclose(torch.tensor(eval(got[8:])), lps, atol=1e-4), (got, lps)


def test_a_reasoning_gym_task_trains_end_to_end(tmp_path):
    """rg:chain_sum on a tiny model with room for its prompts (the system prompt and the worked
    example take ~530 of its byte-level tokens): train problems, grades by the dataset's scorer in
    the grader processes, held-out evals."""
    import prepare
    model = prepare.build_tiny(str(tmp_path / "model"), context=1024)
    steps, evals, _ = train(tmp_path / "run", "--task=rg:chain_sum", f"--model={model}",
                            "--max_model_len=768", "--max_steps=3", "--eval_every=3")
    assert [m["version"] for m in steps] == [1, 2, 3] and [e["version"] for e in evals] == [0, 3]
    assert steps[-1]["reward_failed"] == 0 and steps[-1]["skipped_long"] == 0
    assert all(e["eval_n"] == 20 for e in evals)
    samples = [json.loads(line) for line in open(tmp_path / "run/samples.jsonl")]
    assert len(samples) == 3 * 4 and all(0 <= s["reward"] <= 1 for s in samples)
    asked = samples[0]["prompt"]
    assert [m["role"] for m in asked] == ["system", "user", "assistant", "user"]
    assert asked[-1]["content"].startswith("State the final answer to the following arithmetic")


MISSING = "import sys\nsys.modules[{!r}] = None  # import fails, find_spec finds nothing\n"


@pytest.mark.parametrize("arg, module, message", [
    ("--tracker=wandb", "wandb", "tracker 'wandb' is not installed: pip install wandb"),
    ("--tracker=trackio", "trackio", "tracker 'trackio' is not installed: pip install trackio"),
    ("--task=rg:chain_sum", "reasoning_gym",
     "task 'rg:chain_sum' needs reasoning-gym: pip install reasoning-gym==0.1.25"),
])
def test_a_missing_optional_package_is_a_one_line_error(tiny, tmp_path, arg, module, message):
    (tmp_path / "sitecustomize.py").write_text(MISSING.format(module))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    p = subprocess.run([sys.executable, "train.py", "config/tiny.py", arg], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert [line for line in p.stderr.splitlines() if "error" in line] == [f"error: {message}"]


@pytest.mark.parametrize("args, message", [
    (["--max_stepz=3"],
     "unknown config key 'max_stepz' in --max_stepz=3; did you mean 'max_steps'?"),
    (["--max_steps=three"],
     "config key 'max_steps' in --max_steps=three must be int, got str 'three'"),
    (["--drop_flat=1"], "config key 'drop_flat' in --drop_flat=1 must be bool, got int 1"),
    (["--lr"], "'--lr' has no value: write --lr=VALUE"),
    (["config/nope.py"], "config file 'config/nope.py' not found"),
    (["--max_staleness=-1"], "max_staleness=-1 must be >= 0"),
    (["--grader_workers=0"], "rollout_engines, tensor_parallel_size and grader_workers must be"),
    (["--model=data/missing"],
     "model 'data/missing' is no local folder, nor loads from the hub"),
    (["--task=gsm8k"], "task 'gsm8k' needs --data_path=FILE.jsonl"),
    (["--task=gsm8k", "--data_path=data/none.jsonl"], "data_path 'data/none.jsonl' not found"),
    (["--task=poetry"], "unknown task 'poetry'"),
    (["--task=rg:poetry"], "Dataset 'poetry' not registered"),
    (["--tracker=mlflow"], "unknown tracker 'mlflow': use wandb, trackio or \"\" (none)"),
    (["--resume", "--out_dir=out/never-written"],
     "--resume: no out/never-written/ckpt.pt"),
    (["--lora_rank=12"], "lora_rank=12 is none of vLLM's: 1, 8, 16, 32,"),
    (["--lora_rank=8", "--lora_targets=q_proj,nope_proj"], "lora_targets='q_proj,nope_proj': "),
])
def test_bad_config_is_rejected_clearly(tiny, args, message):
    p = subprocess.run([sys.executable, "train.py", "config/tiny.py", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_bad_files_are_rejected_clearly(tiny, tmp_path):
    for name, arch in [("bert", "BertForMaskedLM"), ("gpt2", "GPT2LMHeadModel")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(
            f'{{"model_type": "{name}", "architectures": ["{arch}"]}}')
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "q", "answer": "1"}\n{"question": "no answer"}\n')
    for args, message in [([f"--model={tmp_path}/bert"],
                           "is a 'BertForMaskedLM': use a causal (decoder-only) LM"),
                          ([f"--model={tmp_path}/gpt2", "--lora_rank=8"],
                           "vLLM has no LoRA for GPT2LMHeadModel"),
                          (["--task=gsm8k", f"--data_path={data}"],
                           f"{data}:2: expected a JSON object")]:
        p = subprocess.run([sys.executable, "train.py", "config/tiny.py", *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_batch_must_split_over_ranks(tiny, tmp_path):
    p = subprocess.run(command(tmp_path, "--batch_groups=3", nproc=2), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "batch_groups=3: use a multiple of the 2 trainer ranks" in p.stderr


def test_a_taken_rollout_port_is_a_clear_error(tiny, tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        # the later --rollout_port wins
        p = subprocess.run(command(tmp_path, "--timeout_s=20", f"--rollout_port={port}"), cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert f"cannot open the trainer<->rollout store on 127.0.0.1:{port}" in p.stderr
    assert "--rollout_port=PORT" in p.stderr
    assert not ours(tmp_path)


KILL_IN_PUSH = """import os, sys, time
if sys.argv[0].endswith("train.py"):
    import psutil, sync
    push, pushes = sync.push, []
    def push_after_a_kill(sender, *args, **kw):
        pushes.append(sender)
        if sender is not None and len(pushes) == 2:  # rank 0's second push: engine 1 dies in it
            engine = [p for p in psutil.Process().children() if p.cmdline()[-1] == "1"][0]
            open(os.environ["KILLED"], "w").write(f"{engine.pid} {time.time()}")
            engine.kill()
        return push(sender, *args, **kw)
    sync.push = push_after_a_kill
"""


def test_an_engine_killed_during_a_push_ends_every_process_within_seconds(tiny, tmp_path):
    """Two ranks, two engines; engine 1 is SIGKILLed as rank 0 starts a push: rank 0 names it, and
    every process of the run is gone within 10 s (none waits on the dead engine's collective)."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(KILL_IN_PUSH)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'hook'}{os.pathsep}{ROOT}",
               KILLED=str(tmp_path / "killed"))
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
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(
        "import sys, time\nif sys.argv[0].endswith('train.py'):\n    import torch\n"
        "    step = torch.optim.AdamW.step\n"
        "    torch.optim.AdamW.step = lambda *a, **k: time.sleep(8) or step(*a, **k)\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'hook'}{os.pathsep}{ROOT}")
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


def kill_mid_run(tmp_path, what, find):
    """A two-node run; after two steps the process find(nodes)[0] is SIGKILLed: every process of
    both nodes must be gone, non-zero, within 20 s. -> (the process, each node's stderr)"""
    nodes = two_nodes(tmp_path, "--eval_every=0", "--max_steps=1000", "--timeout_s=60")
    deadline = time.time() + 180
    while len(metrics(tmp_path)[0]) < 2 if (tmp_path / "metrics.jsonl").exists() else True:
        assert time.time() < deadline and all(p.poll() is None for p in nodes)
        time.sleep(0.2)
    victim = find(nodes)[0]
    t0 = time.time()
    victim.kill()
    while ours(tmp_path):
        time.sleep(0.1)
    took = time.time() - t0
    errs = [p.communicate(timeout=60)[1] for p in nodes]
    print(f"\nnode 1's {what} SIGKILLed: both nodes gone {took:.1f} s later")
    assert all(p.returncode != 0 for p in nodes) and took < 20, errs[0][-3000:]
    return victim, errs


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
    for _ in range(3):
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


HANG = """import sys, time
if sys.argv[0].endswith("rollout.py"):  # the engine's loop asks its budget every iteration
    import budget
    take, calls = budget.Budget.take, []
    def hang_after_200(self, *args):
        calls.append(1)
        if len(calls) > 200:
            time.sleep(3600)  # a driver fault, a deadlock: the process lives, its loop does not
        return take(self, *args)
    budget.Budget.take = hang_after_200
"""


def test_an_engine_whose_loop_hangs_is_named(tiny, tmp_path):
    """The engine's loop stops moving after 200 iterations, its heartbeat thread going on: rank 0
    names it once it has not moved for timeout_s, and the run is gone soon after."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(HANG)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'hook'}{os.pathsep}{ROOT}")
    t0 = time.time()
    p = subprocess.run(command(tmp_path / "run", "--eval_every=0", "--max_steps=1000",
                               "--timeout_s=8"), cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode != 0 and not ours(tmp_path)
    assert "rollout process 0 (node 0): its loop has not moved for" in p.stderr, p.stderr[-3000:]
    assert time.time() - t0 < 120
