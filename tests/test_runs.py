"""Runs of the real thing on the tiny model that should succeed, and what they produce: torchrun,
trainer ranks, vLLM rollout processes, the process groups between them; on-policy and asynchronous
runs, environments, several ranks, engines and nodes, an exact resume after a kill, fp16, LoRA,
trackers."""
import json
import math
import os
import re
import subprocess
import sys

import psutil
import pytest
import torch

from conftest import ROOT
from e2e import KEYS, SYNC, hook, metrics, ours, start, train, trackio_run, two_nodes, wandb_run


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


def test_an_environment_keeps_its_state_across_turns_and_trains_on_the_models_tokens(tiny,
                                                                                    tmp_path):
    """tests/toy_envs.py's Counter, η = 0 in fp32: each answer's replies count 1, 2, 3 (its own
    object served all its turns, and no other answer's); the behaviour logprobs of the model's
    tokens, over all turns, equal the trainer's; the replies' tokens are counted apart; steps that
    raise or hang past reward_timeout_s end their answer alone, counted by kind, the first of
    each shown once; held-out seeds are never trained on; no process is left behind."""
    env = dict(os.environ, TOOL_MISBEHAVES="1")
    # 64 tokens an answer: a turn ends in "1" (a reply comes) in about half of them, where 24
    # left 16 logged answers without a reply in one CI run
    steps, evals, p = train(tmp_path / "run", *SYNC, "--max_steps=4", "--max_turns=3",
                            "--max_new_tokens=64",
                            "--reward_timeout_s=2", "--task=env:tests/toy_envs.py:Counter",
                            "--eval_every=4", env=env)
    for m in steps:
        assert m["logprob_mismatch"] < 1e-5 and m["staleness_max"] == 0, m
        assert 1 <= m["turns_mean"] <= 3, m
    assert max(m["turns_mean"] for m in steps) > 1.2, steps
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
                        "--max_new_tokens=64", "--task=env:tests/toy_envs.py:GymCounter", "--eval_every=0")
    assert max(m["turns_mean"] for m in steps) > 1 and steps[-1]["env_errors"] == 0, steps


def test_a_slow_grader_does_not_stall_the_engine(tiny, tmp_path):
    """Every answer takes 50 ms to grade (a sitecustomize module slows the grader in every process
    of the run): the engine loop spends under 10% of its stepping time on grades, where waiting for
    each one would take more time than stepping (the loop makes a batch's 16 answers in a few
    steps of a few ms)."""
    env = hook(tmp_path, "slow_grader")
    steps, _, _ = train(tmp_path / "run", "--max_steps=3", env=env)
    m = steps[-1]
    assert m["reward_failed"] == 0 and m["rollout_tokens"] > 0
    assert m["rollout_grade_s"] < 0.1 * m["rollout_engine_s"], m


@pytest.mark.xdist_group("sync_run")  # one worker runs the fixture once
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


@pytest.mark.xdist_group("sync_run")
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


@pytest.mark.xdist_group("sync_run")
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
    # a KV cache of 1 GiB: without it vLLM's CPU backend reserves a share of all of the
    # machine's memory, and may refuse to start while other processes (another test's run) hold
    # some
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "whole" / "merged")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))
    lps = torch.log_softmax(merged[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
    got = [line for line in p.stdout.splitlines() if line.startswith("logprobs")]
    assert p.returncode == 0 and got, p.stderr[-3000:]
    got = got[0]
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
