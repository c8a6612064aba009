"""Run by test_loss.py under torchrun: one optimizer step of FSDP2 (loss.shard, as train.py wraps
it) on a fixed batch of groups whose completions have very different lengths, dealt out to the
ranks as train.py deals them, in packed micro-batches of at most 100 tokens, with train.py's
gradient accumulation (loss.shard, and set_requires_gradient_sync / set_reshard_after_backward
as train.py sets them). Rank 0 saves the weights after the step, and each rank's number of
micro-batches to OUT_FILE.micro_batches. An optional third argument "ckpt" turns on activation
checkpointing.
Usage: torchrun --nproc_per_node=W fsdp_peer.py MODEL_DIR OUT_FILE [ckpt]"""
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
lens = [[1, 2, 2, 3], [40, 41, 1, 3], [5, 6, 7, 8], [39, 2, 40, 1]]  # two short, two long
groups = [{"prompt_ids": ids(5 + i),
           "completions": [{"ids": ids(n), "mask": [1] * n, "logprobs": [0.0] * n,
                            "versions": [0] * n, "reward": float(i == j)}
                           for j, n in enumerate(ls)]}
          for i, ls in enumerate(lens)]
n_tok = float(sum(map(sum, lens)))
mine = loss.micro_batches(buffer.deal(groups, world)[rank], 100)
for i, micro in enumerate(mine):
    last = i == len(mine) - 1
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(last)
    batch = loss.to_device(loss.pack(micro), torch.device("cpu"))
    logp = loss.token_logprobs(model, batch, 0.7)
    adv = loss.group_advantages(batch["rewards"], 4)
    out, _ = loss.grpo_loss(logp, logp.detach(), adv, batch["mask"], n_tok)
    (out * world).backward()
opt.step()
full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
counts = [None] * world
dist.all_gather_object(counts, len(mine))
if rank == 0:  # the weights, and how many micro-batches each rank ran
    torch.save(full, sys.argv[2])
    open(sys.argv[2] + ".micro_batches", "w").write(str(counts))
dist.destroy_process_group()
