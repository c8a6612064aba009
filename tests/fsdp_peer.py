"""Run by test_loss.py under torchrun: one optimizer step of FSDP2 (loss.shard, as train.py wraps
it) on a fixed batch of groups whose completions have very different lengths, dealt out to the ranks
as train.py deals them; ranks agree on the number of chunks (loss.agreed_chunks). Rank 0 saves the
weights after the step, and pad_frac to OUT_FILE.pad_frac. An optional third argument "ckpt" turns
on activation checkpointing.
Usage: torchrun --nproc_per_node=W fsdp_peer.py MODEL_DIR OUT_FILE"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import buffer  # noqa: E402
import loss  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
loss.shard(model, torch.float32, checkpointing=sys.argv[3:] == ["ckpt"])
opt = torch.optim.SGD(model.parameters(), lr=1.0)
g = torch.Generator().manual_seed(0)
ids = lambda n: torch.randint(5, 500, (n,), generator=g).tolist()
lens = [[1, 2, 2, 3], [40, 41, 1, 3], [5, 6, 7, 8], [39, 2, 40, 1]]  # rank 1 gets the long ones
groups = [{"prompt_ids": ids(5 + i),
           "completions": [{"ids": ids(n), "mask": [1] * n, "reward": float(i == j)}
                           for j, n in enumerate(ls)]}
          for i, ls in enumerate(lens)]
n_tok, positions = float(sum(map(sum, lens))), torch.zeros(2, dtype=torch.float64)
for grp in buffer.deal(groups, world)[rank]:  # one group per micro-batch (none is flat)
    n_chunks = loss.agreed_chunks([grp], world, "cpu")
    logp, mask, (computed, real) = loss.token_logprobs(model, [grp], 0.7, "cpu", n_chunks=n_chunks)
    positions += torch.tensor([computed, real])
    adv = loss.group_advantages(torch.tensor([c["reward"] for c in grp["completions"]]), 4)
    out, _ = loss.grpo_loss(logp, logp.detach(), adv, mask, n_tok)
    (out * world).backward()
opt.step()
full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
dist.all_reduce(positions)
if rank == 0:  # the weights, and pad_frac: the padded share of the positions computed
    torch.save(full, sys.argv[2])
    open(sys.argv[2] + ".pad_frac", "w").write(str(1 - (positions[1] / positions[0]).item()))
dist.destroy_process_group()
