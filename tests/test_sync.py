"""Weights go from a trainer process into a real vLLM engine in another process: its worker is a
rank of the weight group and receives them itself (sync.join, sync.stage, sync.load), in
buckets: staged while it generates, or paused (stage_weights=False: no copy, each bucket loaded
as it comes), or, colocated, through shared memory. After each push vLLM's sampled-token logprobs
equal the trainer's own log_softmax(logits / T) on the new weights, and not on the old. With
LoRA only the adapter travels, and the engine swaps it in place of the one it serves."""
import copy
import json
import os
import subprocess
import sys
import time
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import lora
import sync
from conftest import ROOT, free_port


def logprobs(model, prompt, completion, temperature=0.7):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("kind, colocate, staged", [
    ("tied", False, True), ("untied", False, True), ("tied", True, True), ("untied", False, False),
    ("lora", False, True), ("lora", True, True)])
def test_weights_reach_vllm_and_logprobs_match(tiny, kind, colocate, staged, monkeypatch):
    path = tiny["untied" if kind == "untied" else "tied"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings == (kind != "untied")
    rank = 8 if kind == "lora" else 0
    prompt = AutoTokenizer.from_pretrained(path).encode("What is 12 + 7?")
    port = free_port()
    cfg = {"rollout_dtype": "float32", "colocate": colocate, "rollout_port": port, "timeout_s": 60,
           "tensor_parallel_size": 1, "stage_weights": staged,
           "lora_rank": rank, "lora_alpha": 16, "lora_targets": "all-linear"}
    if rank:  # the trainer's adapters: A random, B zero (the base's outputs)
        model = lora.add(model, cfg, torch.float32)
    monkeypatch.setattr(sync, "BUCKET", 2**16)  # several buckets; the embedding (128 KiB) alone
    store = sync.open_store("127.0.0.1", port, True, 60)
    store.set("prompt", json.dumps(prompt))
    peer = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests/vllm_peer.py"), path,
                             str(port), json.dumps(cfg)])
    try:
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        meta = [(n, tuple(p.shape)) for n, p in trained]  # a tied embedding once
        plan = sync.plan(meta, torch.float32)
        if not rank:
            assert len(plan) > 2 and any(len(weights) == 1 for _, _, weights in plan)
        ctls, _ = sync.connect(store, 0, 1, 60)
        sender = sync.Sender(store, plan, cfg, torch.device("cpu"), ctls)
        versions = [copy.deepcopy(model)]
        for k in (1, 2):
            torch.manual_seed(k)
            with torch.no_grad():
                for _, p in trained:
                    p.add_(torch.randn_like(p) * 0.05)
            sender.push(iter(trained), k)
            versions.append(copy.deepcopy(model))
            store.wait([f"loaded{k}"])  # else version 2 may replace 1 before it is sent
        assert peer.wait(timeout=60) == 0
        samples = json.loads(store.get("samples"))
    finally:
        peer.kill()
    # colocate: nothing left behind
    assert not [f for f in os.listdir("/dev/shm") if str(port) in f]
    for k, got in enumerate(samples):  # vLLM sampled from version k: its logprobs are version k's
        for ids, lps in got:
            lps = torch.tensor(lps)
            assert torch.allclose(lps, logprobs(versions[k], prompt, ids), atol=1e-4), k
            if k:  # a silent no-op update cannot pass
                assert (lps - logprobs(versions[k - 1], prompt, ids)).abs().max() > 1e-2


def test_a_busy_engine_gets_the_newest_weights(tiny, monkeypatch):
    """The engine loads version 1; 2 is sent into its copy and announced; 3 and 4 are pushed while
    the engine, busy, has not loaded 2. Once it has, it is sent 4, the newest, not 3 (what was
    newest when its sender freed up); rank 0 never holds more than two snapshots meanwhile."""
    model = AutoModelForCausalLM.from_pretrained(tiny["tied"], dtype=torch.float32)
    trained = [*model.named_parameters()]
    port = free_port()
    cfg = {"rollout_dtype": "float32", "colocate": False, "rollout_port": port, "timeout_s": 60,
           "tensor_parallel_size": 1, "stage_weights": True, "newest": True}
    alive, new_copy = [], sync.new_copy  # each snapshot rank 0 makes, while it lives
    monkeypatch.setattr(sync, "new_copy", lambda *a: alive.append(weakref.ref(t := new_copy(*a)))
                        or t)
    store = sync.open_store("127.0.0.1", port, True, 60)
    peer = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests/vllm_peer.py"),
                             tiny["tied"], str(port), json.dumps(cfg)])
    steps = iter(range(100))

    def engine(*cmds):  # the engine reads an announced version ("ctl"), or loads
        for cmd in cmds:
            i = next(steps)
            store.set(f"cmd{i}", cmd)
            store.wait([f"did{i}"])

    try:
        ctls, _ = sync.connect(store, 0, 1, 60)
        sender = sync.Sender(store, sync.plan([(n, p.shape) for n, p in trained], torch.float32),
                             cfg, torch.device("cpu"), ctls)
        held = []
        for v in (1, 2, 3, 4):
            sender.push(iter(trained), v)
            held.append(sum(r() is not None for r in alive))
            if v == 1:
                engine("ctl", "load")
            elif v == 2:
                engine("ctl")  # received into its copy, announced, not loaded
            time.sleep(0.5)
        engine("load", "ctl", "load")
        store.set(f"cmd{next(steps)}", "end")
        assert peer.wait(timeout=60) == 0
        assert json.loads(store.get("got")) == [1, 1, 2, 2, 4, 4]
        assert max(held) <= 2, held
    finally:
        peer.kill()
