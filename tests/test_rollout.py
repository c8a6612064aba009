"""One real rollout process driven by this test as trainer rank 0 would drive it (fleet.Fleet,
Sender.push): new weights every 0.1 s while long answers are generated.

Odd versions make the policy sharply peaked, even versions exactly uniform (the final norm's weight
zeroed: every logit is 0, whatever the KV cache holds), so each token's logprob says which weights
sampled it. The version each token is tagged with must say the same, across loads mid-answer. The
engine-0 eval runs across those loads: it does not hold them up, and reports the versions it saw."""
import ast
import math
import re
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import fleet as fleet_mod
import lora as lora_mod
from reward import is_flat
import sync
from conftest import ROOT, free_port


def push(fleet, tensors, v):
    """As train.py pushes, then until every engine has loaded it (budget.py's `loaded{e}`): each
    version reaches the engines, none skipped for a newer one."""
    fleet.sender.push(tensors, v)
    while any(fleet.store.get(f"loaded{e}") != str(v).encode() for e in range(fleet.engines)):
        fleet.check_alive()
        time.sleep(0.01)


def defaults():  # train.py's default config, without running train.py
    tree = ast.parse(open(f"{ROOT}/train.py").read())
    return {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
            and isinstance(n.value, ast.Constant)}


@pytest.mark.parametrize("tool", [False, True])
def test_every_token_is_tagged_with_the_weights_that_sampled_it(tiny, tool, tmp_path, monkeypatch):
    """tool: tests/toy_envs.py's Counter, whose replies answer turns that end in "1": the same
    across turns, which may each meet other weights; the replies carry no logprob and no loss."""
    task = "env:tests/toy_envs.py:Counter" if tool else "arithmetic"
    monkeypatch.chdir(ROOT)
    cfg = dict(defaults(), model=tiny["tied"], task=task, rollout_port=free_port(),
               max_new_tokens=160,
               max_model_len=224, batch_groups=1000, group_size=4, rollout_seqs=16,
               max_staleness=0, eval_every=1, eval_n=100, timeout_s=60, max_steps=1000,
               max_turns=4)
    model = AutoModelForCausalLM.from_pretrained(tiny["tied"], dtype=torch.float32)
    meta = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    plan = sync.plan(meta, torch.float32)
    fleet = fleet_mod.Fleet(cfg, plan, torch.device("cpu"), [[]], {}, lambda: False)
    try:
        for v in range(1, 13):
            time.sleep(0.1)
            scale = 0.0 if v % 2 == 0 else 40.0
            push(fleet, ((n, p * scale if n == "model.norm.weight" else p)
                         for n, p in model.named_parameters()), v)
        deadline = time.time() + 120
        # a fourth turn comes to ~4 of 32 answers, 0 in one CI run: 16 groups with a tool
        while len(fleet.buffer.groups) < (16 if tool else 8) and time.time() < deadline:
            fleet.check_alive()
            time.sleep(0.1)
        fleet.wait(lambda: any(e["version"] == 12 for e in fleet.evals), 120)
        groups = list(fleet.buffer.groups)
        fleet.stop(60)
    finally:
        fleet.close()
        fleet_mod.kill(fleet.procs)
    uniform, mixed, tagged, turns = -math.log(model.config.vocab_size), 0, set(), []
    for g in groups:
        for c in g["completions"]:
            assert len(c["versions"]) == len(c["logprobs"]) == len(c["ids"]) == len(c["mask"])
            # arrays (rollout.TOKENS), the logprobs at vLLM's own precision
            assert [c[k].dtype for k in ("ids", "logprobs", "versions", "mask")] == [
                np.int32, np.float32, np.int32, np.int32]
            assert list(c["versions"]) == sorted(c["versions"]) and len(c["ids"]) <= 160
            m = list(c["mask"])  # the tool's words: a run of 0s before each turn after the first
            assert c["turns"] <= 4 and sum(a > b for a, b in zip([1] + m, m)) == c["turns"] - 1
            turns.append(c["turns"])
            mixed += len(set(c["versions"]) - {0}) > 1
            for v, lp, model_token in zip(c["versions"], c["logprobs"], c["mask"]):
                tagged.add(v)
                if not model_token:  # the tool's: context only
                    assert lp == 0.0
                elif v:  # version 0 is the model as saved: neither peaked nor uniform
                    assert (abs(lp - uniform) < 1e-4) == (v % 2 == 0), (v, lp, c["versions"])
    assert mixed >= 3 and len(tagged) >= 6, (mixed, tagged)  # loads did land mid-answer
    if tool:  # each answer's own environment object served all its turns, and only those
        counts = [[int(n) for n in re.findall(r" <reply (\d+)>", c["text"])]
                  for g in groups for c in g["completions"]]
        assert all(c == list(range(1, len(c) + 1)) for c in counts), counts
        assert sum(len(c) >= 2 for c in counts) >= 3, counts
    assert (max(turns) == 4) == tool, turns  # max_turns: a fourth turn is final whatever it says
    # evals ran across loads: no load waited for one
    evals = {e["version"]: e for e in fleet.evals}
    assert 0 in evals and 12 in evals and evals[12]["eval_versions"] == [12, 12]
    assert any(lo < hi for lo, hi in (e["eval_versions"] for e in evals.values()))
    assert all(e["eval_versions"][0] >= e["version"] for e in evals.values())


@pytest.mark.parametrize("lora", [0, 8])
def test_a_completion_that_lives_through_loads_is_what_each_version_computed_over_its_kv(tiny,
                                                                                          lora):
    """Why logprob_mismatch leaves out completions that lived through a load: their tokens after the
    load come from the new weights over a KV cache that older weights wrote. Replaying each answer
    token by token, each position with the weights its tag names, reproduces vLLM's logprobs
    (fp32): the tags and the behaviour logprobs are exact; the final weights alone do not. With
    LoRA only the adapter changes and travels; the engine swaps it in place, requests in flight."""
    from transformers import DynamicCache
    cfg = dict(defaults(), model=tiny["untied"], rollout_port=free_port(), max_new_tokens=64,
               max_model_len=128, batch_groups=1000, group_size=2, rollout_seqs=8,
               max_staleness=0, eval_every=0, timeout_s=60, max_steps=1000, lora_rank=lora,
               lora_alpha=16)
    model = AutoModelForCausalLM.from_pretrained(tiny["untied"], dtype=torch.float32).eval()
    if lora:
        model = lora_mod.add(model, cfg, torch.float32)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    meta = [(n, tuple(p.shape)) for n, p in trained]
    plan = sync.plan(meta, torch.float32)
    states = [{k: v.clone() for k, v in model.state_dict().items()}]
    fleet = fleet_mod.Fleet(cfg, plan, torch.device("cpu"), [[]], {}, lambda: [])
    try:
        for v in range(1, 9):
            time.sleep(0.1)
            torch.manual_seed(v)
            with torch.no_grad():
                for _, p in trained:
                    p.add_(torch.randn_like(p) * (0.1 if lora else 0.02))
            states.append({k: t.clone() for k, t in model.state_dict().items()})
            push(fleet, iter(trained), v)
        deadline = time.time() + 120
        while len(fleet.buffer.groups) < 6 and time.time() < deadline:
            fleet.check_alive()
            time.sleep(0.1)
        groups = list(fleet.buffer.groups)
        fleet.stop(60)
    finally:
        fleet.close()
        fleet_mod.kill(fleet.procs)
    lived = [(g["prompt_ids"], c) for g in groups for c in g["completions"]
             if len(set(c["versions"])) > 1][:4]
    assert lived, "no completion lived through a load"
    replay_err, final_err = [], []
    for prompt, c in lived:
        seq, cache = prompt + c["ids"].tolist(), DynamicCache()
        for j in range(len(seq) - 1):  # position j computes token j + 1, with that token's tag
            k = j + 1 - len(prompt)  # its index in the answer (< 0: still the prompt)
            model.load_state_dict(states[c["versions"][max(k, 0)]])
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([[seq[j]]]), past_key_values=cache,
                               use_cache=True).logits[0, -1]
            if k >= 0:
                lp = torch.log_softmax(logits.float(), -1)[seq[j + 1]].item()
                replay_err.append(abs(lp - c["logprobs"][k]))
        model.load_state_dict(states[c["versions"][-1]])  # the trainer's view: one version
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0, len(prompt) - 1:-1]
        lps = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(c["ids"])[:, None])
        fresh = [i for i, v in enumerate(c["versions"]) if v == c["versions"][-1]]
        final_err += [abs(lps[i].item() - c["logprobs"][i]) for i in fresh]
    final = sum(final_err) / len(final_err)
    print(f"\n{len(lived)} answers across loads: replayed by tag, max |dlogp| "
          f"{max(replay_err):.1e}; their last version's tokens by those weights alone, {final:.1e}")
    assert max(replay_err) < 1e-4 and final > 1e-3


def test_the_engines_start_no_more_than_the_budget_and_share_it(tiny):
    """Two real engines, eta = 0, drop_flat: nearly every group of the random model is flat, so
    each engine gives its start back as it sends it, and starts a replacement. Whenever a group
    arrives, the two engines together have started at most (v + 1) * batch_groups, v the newest
    version announced, plus the flat groups they have sent; both engines generate at nearly every
    version (each has its half reserved after a load, budget.py)."""
    cfg = dict(defaults(), model=tiny["tied"], rollout_port=free_port(), max_new_tokens=8,
               max_model_len=128, batch_groups=4, group_size=4, rollout_seqs=16, max_staleness=0,
               drop_flat=True, eval_every=0, timeout_s=60, max_steps=1000, rollout_engines=2)
    model = AutoModelForCausalLM.from_pretrained(tiny["tied"], dtype=torch.float32)
    meta = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    plan = sync.plan(meta, torch.float32)
    fleet = fleet_mod.Fleet(cfg, plan, torch.device("cpu"), [[], []], {}, lambda: [])
    arrived = [0]  # groups in the buffer as each version's announcement began (one engine
    # may load it and send a group under it before the other has loaded it)
    try:
        for v in range(1, 13):  # 12 versions: a slow start (graders) averages out
            deadline = time.time() + 60
            while len(fleet.buffer.groups) < arrived[-1] + 8 and time.time() < deadline:
                fleet.check_alive()
                time.sleep(0.05)
            arrived.append(len(fleet.buffer.groups))
            push(fleet, model.named_parameters(), v)
        groups = list(fleet.buffer.groups)
        fleet.stop(60)
    finally:
        fleet.close()
        fleet_mod.kill(fleet.procs)
    flat, started, seen = [0, 0], [0, 0], set()
    for i, g in enumerate(groups):
        e, v = g["engine"], max(k for k, n in enumerate(arrived) if n <= i)
        flat[e] += is_flat(g)
        started[e] = g["stats"]["rollout_started"]  # the other's: as of its last group, or fewer
        assert sum(started) <= (v + 1) * 4 + sum(flat), (i, e, v, started, flat)
        seen.add((e, g["version_min"]))
    # fair: each engine makes a quarter of the groups or more (past its share of each version,
    # whoever frees a slot first takes it), at 4 of the first 5 versions or more (a version may
    # pass while an engine's slots are still full of the last one's)
    made = [sum(g["engine"] == e for g in groups) for e in (0, 1)]
    at = [len({v for f, v in seen if f == e} & set(range(5))) for e in (0, 1)]
    assert sum(flat) > 10 and min(made) >= sum(made) / 4 and min(at) >= 4, (flat, made, seen)
