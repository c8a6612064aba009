import pytest
import torch

from loss import group_advantages, grpo_loss


def test_group_advantages_are_rewards_minus_the_group_mean():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0]), 2)
    assert adv.tolist() == [0.5, -0.5, 0.0, 0.0, 0.0, 0.0]


def one_token(adv, ratio, **kw):
    """One completion token, advantage adv, pi_theta / pi_behav = ratio
    -> (loss, dloss/dlogp, bounded)."""
    logp = torch.tensor([[0.0]], requires_grad=True)
    behav = torch.tensor([[-torch.log(torch.tensor(ratio)).item()]])
    loss, truncated = grpo_loss(logp, behav, torch.tensor([adv]), torch.ones(1, 1), 1.0, **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), truncated


@pytest.mark.parametrize("adv, ratio, want_loss, want_grad, bounded", [
    (1.0, 1.1, -1.1, -1.1, 0),    # a stale token pi_theta now likes more: weight rho,
                                  # gradient -A * rho
    (1.0, 1.5, -1.5, -1.5, 0),    # moved far already: still the full weight (no clip silences it)
    (-1.0, 0.5, 0.5, 0.5, 0),     # a bad token pi_theta already avoids: its push down shrinks
                                  # with rho
    (1.0, 5.0, 0.0, 0.0, 1),      # above high: too far off-policy, left out of the loss
    (-1.0, 0.1, 0.0, 0.0, 1),     # below low: the same
    (0.0, 1.7, 0.0, 0.0, 0),      # zero advantage: nothing
])
def test_importance_weights_and_their_bounds(adv, ratio, want_loss, want_grad, bounded):
    loss, grad, bounded_mask = one_token(adv, ratio, low=0.125, high=3.0)
    assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    assert grad == pytest.approx(want_grad, rel=1e-5, abs=1e-6)
    assert bounded_mask.sum().item() == bounded


@pytest.mark.parametrize("rho, w, bounded", [
    # the geometric mean of each completion's ratios: sqrt(4 * 0.1) = 0.632 and sqrt(1.5 * 2)
    # = 1.732, inside [0.2, 3]; token by token 4.0 and 0.1 would be out
    ([[4.0, 0.1], [1.5, 2.0]], [[0.4**0.5] * 2, [3**0.5] * 2], [[0, 0], [0, 0]]),
    # sqrt(4 * 4) = 4 > 3: the whole first completion is out
    ([[4.0, 4.0], [1.5, 2.0]], [[0.0, 0.0], [3**0.5] * 2], [[1, 1], [0, 0]]),
])
def test_one_weight_per_completion_by_hand(rho, w, bounded):
    logp = torch.zeros(2, 2, requires_grad=True)
    loss, got = grpo_loss(logp, -torch.tensor(rho).log(), torch.tensor([1.0, -1.0]),
                          torch.ones(2, 2), 4.0, low=0.2, high=3.0)
    loss.backward()
    w, adv = torch.tensor(w), torch.tensor([[1.0], [-1.0]])
    assert loss.item() == pytest.approx((-adv * w).sum().item() / 4, rel=1e-5)
    assert torch.allclose(logp.grad, -adv * w / 4, rtol=1e-5)
    assert got.int().tolist() == bounded


def test_token_level_normalisation():
    # two sequences, 1 and 3 completion tokens, every ratio 1: the loss is the mean over the 4
    # tokens (-(1 + 3*-1)/4), not the mean of per-sequence means (which would be 0)
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    loss, truncated = grpo_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask,
                                n_tokens=4.0)
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    assert logp.grad.tolist() == [[-0.25, 0.0, 0.0], [0.25, 0.25, 0.25]]  # padding gets no gradient
    assert not truncated.any()


def test_micro_batches_add_up_to_the_batch_mean():
    torch.manual_seed(0)
    logp, behav = torch.randn(4, 5) * 0.1, torch.randn(4, 5) * 0.1
    mask = (torch.rand(4, 5) > 0.3).float()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    n = mask.sum()
    whole, _ = grpo_loss(logp, behav, adv, mask, n)
    parts = sum(grpo_loss(logp[i:i + 2], behav[i:i + 2], adv[i:i + 2], mask[i:i + 2], n)[0]
                for i in (0, 2))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def plain_logprobs(model, groups, temperature):
    """The straightforward computation: each prompt + completion alone, full logits, log_softmax."""
    rows = []
    for grp in groups:
        for c in grp["completions"]:
            p = grp["prompt_ids"]
            logits = (model(torch.tensor([p + c["ids"]])).logits[0, len(p) - 1:-1].float()
                      / temperature)
            rows.append(torch.log_softmax(logits, -1)
                        .gather(-1, torch.tensor(c["ids"])[:, None])[:, 0])
    return rows


def random_groups(vocab, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(5, vocab, (n,), generator=g).tolist()
    return [{"prompt_ids": ids(7 + 4 * i),
             "completions": [{"ids": ids(n), "mask": [1] * n, "logprobs": [0.0] * n,
                              "versions": [0] * n, "reward": 0.0} for n in ls]}
            for i, ls in enumerate(lens)]


def packed_logprobs(model, groups, temperature):
    import loss
    batch = loss.to_device(loss.pack(groups), torch.device("cpu"))
    return loss.token_logprobs(model, batch, temperature), batch


@pytest.mark.parametrize("model_kind, keep_mb", [
    ("tiny", 512), ("tiny-ckpt", 512), ("tiny-compiled-ckpt", 512), ("vocab50k", 512),
    ("vocab50k", 0)])
def test_token_logprobs_and_gradients_equal_the_plain_computation(tiny, model_kind, keep_mb,
                                                                   monkeypatch):
    """Two groups packed into one sequence (each prompt once, each completion attending to its
    prompt and itself only), with grouped-query heads, and an output layer that scores only the
    sampled tokens change nothing: every row, and the gradient of every weight, equal a plain
    full-logits forward of prompt + completion alone."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
    import loss
    if model_kind.startswith("tiny"):
        model = AutoModelForCausalLM.from_pretrained(tiny["tied"], dtype=torch.float32)
        # whole-layer activation checkpointing: recomputed, the same; compiled inside it (as on
        # GPUs, where it runs the varlen kernel) too
        loss.wrap_layers(model, "compiled" in model_kind, "ckpt" in model_kind)
    else:  # a random 2-layer model with a 50k vocabulary, untied, 4 query heads on 2 KV heads
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=50000, hidden_size=128,
                                             intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=32, tie_word_embeddings=False))
    model.set_attn_implementation("nanoasync_packed")
    # a one-token answer, two prompt lengths
    lens = [[1, 17, 3, 30], [9, 2, 30, 30]]
    groups = random_groups(model.config.vocab_size, lens)
    # keep_mb=0 and 16-position output chunks: the output layer recomputes its softmax in backward,
    # chunk by chunk
    monkeypatch.setattr(loss.token_logprobs, "__defaults__",
                        (16, 0) if keep_mb == 0 else (1024, 2048))
    from torch._dynamo.utils import counters
    counters.clear()
    logp, batch = packed_logprobs(model, groups, 0.7)
    # compiled around a checkpoint, not inside it, nothing is compiled (the results log)
    assert counters["stats"]["unique_graphs"] == ("compiled" in model_kind)
    mask = batch["mask"]
    assert logp.shape == (8, 30) and mask.sum() == sum(map(sum, lens))
    # no padding: each prompt once, each completion but its last token
    assert len(batch["ids"]) == 7 + 11 + sum(n - 1 for ls in lens for n in ls)
    w = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))  # an arbitrary loss
    (logp * w).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for layer in model.model.layers:  # the reference: eager, no checkpoint
        vars(layer).pop("forward", None)
    model.set_attn_implementation("sdpa")
    want = plain_logprobs(model, groups, 0.7)
    sum((r * w[i, :len(r)]).sum() for i, r in enumerate(want)).backward()
    for i, r in enumerate(want):
        n = len(r)
        assert torch.allclose(logp[i, :n].detach(), r.detach(), atol=1e-5), i
        assert (logp[i, n:] == 0).all() and (mask[i, n:] == 0).all() and (mask[i, :n] == 1).all()
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, atol=1e-5, rtol=1e-4), n


def test_micro_batches_hold_whole_groups_up_to_a_token_budget():
    # packed tokens: 7 + 4, 11 + 79, 15 + 9, 19 + 1
    groups = random_groups(500, [[3, 3], [40, 41], [5, 6], [1, 2]])
    assert [loss_mod().tokens(g) for g in groups] == [11, 90, 24, 20]
    batches = loss_mod().micro_batches(groups, 40)
    assert [[groups.index(g) for g in b] for b in batches] == [[0], [1], [2], [3]]
    batches = loss_mod().micro_batches(groups, 120)  # a larger group alone, never split
    assert [[groups.index(g) for g in b] for b in batches] == [[0, 1], [2, 3]]


def test_environment_tokens_never_reach_the_loss(tiny):
    """A tool's tokens inside a completion (mask 0) are context only: whatever behaviour logprobs
    they carry, every weight's gradient is the same; the same change on the model's tokens changes
    it (so this test can fail)."""
    from transformers import AutoModelForCausalLM
    import loss
    model = AutoModelForCausalLM.from_pretrained(tiny["tied"], dtype=torch.float32)
    groups = random_groups(model.config.vocab_size, [[12, 20, 7, 16]])
    for c, (a, b) in zip(groups[0]["completions"], [(3, 6), (5, 12), (0, 0), (9, 16)]):
        c["mask"] = [0 if a <= t < b else 1 for t in range(len(c["ids"]))]
        c["logprobs"] = [-1.0] * len(c["ids"])

    model.set_attn_implementation("nanoasync_packed")

    def grads(where, shift):  # the loss's gradients, behaviour logprobs off by shift at `where`
        model.zero_grad()
        logp, batch = packed_logprobs(model, groups, 1.0)
        mask = batch["mask"]
        behav = logp.detach().clone()  # on-policy: every weight 1, inside the bounds
        for i, c in enumerate(groups[0]["completions"]):
            for t, m in enumerate(c["mask"]):
                behav[i, t] += shift if where(m) else 0.0
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
        out, _ = grpo_loss(logp, behav, adv, mask, float(mask.sum()))
        out.backward()
        return mask, {n: p.grad.clone() for n, p in model.named_parameters()}

    mask, base = grads(lambda m: False, 0.0)
    assert mask.sum() == 12 + 20 + 7 + 16 - 3 - 7 - 7  # the model's tokens only
    assert any(g.abs().sum() > 0 for g in base.values())
    _, env = grads(lambda m: m == 0, -30.0)  # wild behaviour logprobs on the tool's tokens
    assert all(torch.equal(base[n], env[n]) for n in base)
    _, model_tok = grads(lambda m: m == 1, 0.3)
    assert not all(torch.allclose(base[n], model_tok[n]) for n in base)


def loss_mod():
    import loss
    return loss


def test_two_ranks_with_very_different_lengths_step_like_one(tiny, tmp_path):
    """FSDP2 over 2 gloo ranks, one with 1-3 token answers and one with ~40, packed into
    micro-batches of at most 100 tokens, so that the ranks run different numbers of them (no
    collective between micro-batches: gradients reduce once, weights stay gathered), with
    whole-layer activation checkpointing: the same weights after a step as 1 rank on the whole
    batch without it."""
    import subprocess
    import sys
    from conftest import ROOT, free_port
    for w, extra in ((1, []), (2, ["ckpt"])):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={w}",
                        f"--master_port={free_port()}", "tests/fsdp_peer.py", tiny["tied"],
                        str(tmp_path / f"{w}.pt"), *extra], cwd=ROOT, check=True, timeout=300,
                       capture_output=True)
    one, two = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    for name in one:
        assert torch.allclose(one[name], two[name], atol=1e-6), name
    # rank 0: one micro-batch; rank 1: two (its groups do not fit in one)
    assert (tmp_path / "2.pt.micro_batches").read_text() == "[1, 2]"


def test_a_lora_base_stays_out_of_fsdp(tiny):
    """LoRA: FSDP2 manages the adapter alone (sharded, gathered into a copy kept all step); the
    frozen base is one plain tensor a weight, in the compute dtype, never gathered into a second
    copy. A packed forward and backward reach the adapter, in fp32."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from torch.distributed.tensor import DTensor
    import lora
    import loss as L
    from conftest import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        cfg = {"lora_rank": 8, "lora_alpha": 16, "lora_targets": "all-linear"}
        net = AutoModelForCausalLM.from_pretrained(tiny["tied"], dtype=torch.bfloat16)
        net = lora.add(net, cfg, torch.bfloat16)
        L.shard(net, torch.bfloat16)
        params = [*net.parameters()]
        assert all(isinstance(p, DTensor) == p.requires_grad for p in params)
        assert {p.dtype for p in params if not p.requires_grad} == {torch.bfloat16}
        assert {p.dtype for p in params if p.requires_grad} == {torch.float32}
        groups = [{"prompt_ids": [5, 6, 7], "completions": [
            {"ids": [8, 9], "mask": [1, 1], "logprobs": [-1.0, -1.0], "versions": [0, 0],
             "reward": r} for r in (0.0, 1.0)]}]
        batch = L.to_device(L.pack(groups), torch.device("cpu"))
        logp = L.token_logprobs(net, batch, 1.0)
        (logp * batch["mask"]).sum().backward()
        assert all(p.grad is not None for p in params if p.requires_grad)
        assert all(p.grad is None for p in params if not p.requires_grad)
    finally:
        dist.destroy_process_group()
