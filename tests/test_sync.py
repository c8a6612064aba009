"""Weights go from a trainer process into a real vLLM engine in another process over sync.py; afterwards vLLM's
sampled-token logprobs equal the trainer's own log_softmax(logits / T) on the new weights, and not on the old."""
import copy
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import sync
from conftest import ROOT, free_port


def logprobs(model, prompt, completion, temperature=0.7):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_weights_reach_vllm_and_logprobs_match(tiny, kind):
    path = tiny[kind]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings == (kind == "tied")
    prompt = AutoTokenizer.from_pretrained(path).encode("What is 12 + 7?")
    port = free_port()
    peer = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests/vllm_peer.py"), path, str(port)])
    try:
        ctl, traj, store = sync.connect("127.0.0.1", port, 0, "cpu", 60)
        meta = [(n, tuple(p.shape)) for n, p in model.state_dict().items()]
        sync.send_obj(ctl, meta, 1)
        sync.send_obj(ctl, prompt, 1)
        old = copy.deepcopy(model)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        sync.send_header(ctl, 1, 0, has_weights=True)
        sync.send_weights(ctl, model.state_dict().items(), sync.plan_buckets(meta, 0.01, torch.float32), torch.float32)
        got = sync.recv_obj(traj, 1)
        assert peer.wait(timeout=60) == 0
    finally:
        peer.kill()
    assert got["buckets"] > 3
    for ids, lps in got["before"]:  # before the update vLLM sampled from the old weights
        assert torch.allclose(torch.tensor(lps), logprobs(old, prompt, ids), atol=1e-4)
    for ids, lps in got["after"]:
        lps = torch.tensor(lps)
        assert torch.allclose(lps, logprobs(model, prompt, ids), atol=1e-4)
        assert (lps - logprobs(old, prompt, ids)).abs().max() > 1e-2  # a silent no-op update cannot pass
