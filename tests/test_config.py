"""Bad input is rejected clearly, in one line and before anything starts: config keys and values,
missing optional packages, model and data files, a batch that does not split over the ranks, a
taken port."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from e2e import command, ours


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
