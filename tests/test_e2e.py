"""The real thing on the tiny model: torchrun, trainer ranks, one vLLM rollout process, the process groups between
them. Also the config errors a user sees before anything starts."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import ROOT, free_port

KEYS = ("step version reward_mean response_len_mean staleness_mean staleness_max mixed_version_frac dropped_stale "
        "dropped_flat loss clip_frac grad_norm samples gen_tokens t_wait_s t_train_s t_sync_s elapsed_s").split()


def train(tmp_path, *overrides, nproc=1, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           "train.py", "config/tiny.py", f"--out_dir={tmp_path}", f"--rollout_port={free_port()}", *overrides]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    left = [q.pid for q in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(q.info["cmdline"] or [])]
    assert not left, f"processes left behind: {left}"
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    return [m for m in lines if "loss" in m], [m for m in lines if "eval_accuracy" in m], p


@pytest.mark.parametrize("nproc, eta", [(1, 1), (2, 2)])
def test_async_run(tiny, tmp_path, nproc, eta):
    steps, evals, _ = train(tmp_path, f"--max_staleness={eta}", "--max_steps=6", nproc=nproc)
    assert [m["version"] for m in steps] == [1, 2, 3, 4, 5, 6]
    for m in steps:
        assert all(k in m for k in KEYS), set(KEYS) - set(m)
        assert m["staleness_max"] <= eta
    assert steps[-1]["samples"] == 6 * 4 * 4 and steps[-1]["gen_tokens"] > 0
    assert max(m["staleness_max"] for m in steps) >= 1  # the rollout really ran ahead of the trainer
    assert [e["version"] for e in evals] == [0, 3, 6] and all(e["eval_n"] == 20 for e in evals)
    config = json.load(open(tmp_path / "train_config.json"))
    assert config["max_staleness"] == eta and config["max_steps"] == 6
    from transformers import AutoModelForCausalLM
    trained = AutoModelForCausalLM.from_pretrained(tmp_path)  # the final model, in Hugging Face format
    assert trained.config.vocab_size == 512


def test_synchronous_run_is_on_policy(tiny, tmp_path):
    steps, _, _ = train(tmp_path, "--max_staleness=0", "--eval_every=0", "--max_steps=5")
    assert len(steps) == 5
    for m in steps:
        assert m["staleness_max"] == 0 and m["mixed_version_frac"] == 0
        # every token was sampled by the weights being trained: after 4 weight pushes the trainer's logprobs still
        # equal vLLM's (fp32), so the sync and the sampled-distribution logprobs are both right
        assert m["logprob_mismatch"] < 1e-4
    assert steps[-1]["grad_norm"] > 0


@pytest.mark.parametrize("args, message", [
    (["--max_stepz=3"], "unknown config key 'max_stepz' in --max_stepz=3; did you mean 'max_steps'?"),
    (["--max_steps=three"], "config key 'max_steps' in --max_steps=three must be int, got str 'three'"),
    (["--drop_flat=1"], "config key 'drop_flat' in --drop_flat=1 must be bool, got int 1"),
    (["--lr"], "'--lr' has no value: write --lr=VALUE"),
    (["config/nope.py"], "config file 'config/nope.py' not found"),
    (["--max_staleness=-1"], "max_staleness=-1 must be >= 0"),
    (["--model=data/missing"], "model 'data/missing' is not a Hugging Face model folder"),
])
def test_bad_config_is_rejected_clearly(args, message):
    p = subprocess.run([sys.executable, "train.py", "config/tiny.py", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_batch_must_split_over_ranks(tiny, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "train.py", "config/tiny.py", "--batch_groups=3", f"--out_dir={tmp_path}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "batch_groups=3 is not divisible by the 2 trainer ranks" in p.stderr


def test_a_killed_rollout_process_stops_training_quickly_and_cleanly(tiny, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}",
           "train.py", "config/tiny.py", f"--out_dir={tmp_path}", f"--rollout_port={free_port()}", "--max_steps=1000",
           "--eval_every=0", "--timeout_s=30"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 180
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.5)
    assert p.poll() is None, p.communicate()[1][-3000:]
    rollout = [q for q in psutil.process_iter(["cmdline"])
               if "rollout.py" in " ".join(q.info["cmdline"] or []) and str(tmp_path) in " ".join(q.info["cmdline"])]
    assert len(rollout) == 1
    t0 = time.time()
    rollout[0].send_signal(signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    took = time.time() - t0
    assert p.returncode != 0
    assert f"the rollout process (pid {rollout[0].pid}) exited with code -9" in err
    assert took < 20, took
    assert not [q for q in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(q.info["cmdline"] or [])]


def test_a_taken_rollout_port_is_a_clear_error(tiny, tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}",
               "train.py", "config/tiny.py", f"--out_dir={tmp_path}", f"--rollout_port={port}", "--timeout_s=20"]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert f"cannot open the trainer<->rollout store on 127.0.0.1:{port}" in p.stderr
    assert "--rollout_port=PORT" in p.stderr
    assert not [q for q in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(q.info["cmdline"] or [])]
