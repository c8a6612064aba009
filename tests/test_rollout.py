"""One real rollout process driven by this test as trainer rank 0 would drive it (buffer.Rollouts,
sync.announce, sync.push): new weights every 0.1 s while long answers are generated.

Odd versions make the policy sharply peaked, even versions exactly uniform (the final norm's weight
zeroed: every logit is 0, whatever the KV cache holds), so each token's logprob says which weights
sampled it. The version each token is tagged with must say the same, across loads mid-answer. The
engine-0 eval runs across those loads: it does not hold them up, and reports the versions it saw."""
import ast
import math
import time

import torch
from transformers import AutoModelForCausalLM

import buffer
import sync
from conftest import ROOT, free_port


def defaults():  # train.py's default config, without running train.py
    tree = ast.parse(open(f"{ROOT}/train.py").read())
    return {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
            and isinstance(n.value, ast.Constant)}


def test_every_token_is_tagged_with_the_weights_that_sampled_it(tiny):
    cfg = dict(defaults(), model=tiny["tied"], rollout_port=free_port(), max_new_tokens=96,
               max_model_len=160, batch_groups=1000, group_size=4, rollout_groups=4,
               max_staleness=0, eval_every=1, eval_n=100, timeout_s=60, max_steps=1000)
    model = AutoModelForCausalLM.from_pretrained(tiny["tied"], dtype=torch.float32)
    meta = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    buckets = sync.plan_buckets(meta, 64, torch.float32)
    fleet = buffer.Rollouts(cfg, buckets, torch.device("cpu"), [[]], {}, lambda: False)
    try:
        for v in range(1, 13):
            time.sleep(0.1)
            scale = 0.0 if v % 2 == 0 else 40.0
            sync.announce(fleet.ctl, v)
            sync.push(fleet.sender, ((n, p * scale if n == "model.norm.weight" else p)
                                     for n, p in model.named_parameters()), buckets)
        deadline = time.time() + 120
        while len(fleet.buffer.groups) < 8 and time.time() < deadline:
            fleet.check_alive()
            time.sleep(0.1)
        fleet.wait_for_eval(12, 120)
        groups = list(fleet.buffer.groups)
        fleet.stop(60)
    finally:
        fleet.kill()
    uniform, mixed, tagged = -math.log(model.config.vocab_size), 0, set()
    for g in groups:
        for c in g["completions"]:
            assert len(c["versions"]) == len(c["logprobs"]) == len(c["ids"])
            assert c["versions"] == sorted(c["versions"])
            mixed += len(set(c["versions"]) - {0}) > 1
            for v, lp in zip(c["versions"], c["logprobs"]):
                tagged.add(v)
                if v:  # version 0 is the model as saved: neither peaked nor uniform
                    assert (abs(lp - uniform) < 1e-4) == (v % 2 == 0), (v, lp, c["versions"])
    assert mixed >= 3 and len(tagged) >= 6, (mixed, tagged)  # loads did land mid-answer
    # evals ran across loads: no load waited for one
    evals = {e["version"]: e for e in fleet.evals}
    assert 0 in evals and 12 in evals and evals[12]["eval_versions"] == [12, 12]
    assert any(lo < hi for lo, hi in (e["eval_versions"] for e in evals.values()))
    assert all(e["eval_versions"][0] >= e["version"] for e in evals.values())
