# The GPU recipe: Qwen2.5-1.5B-Instruct on GSM8K (hub ids; the machine must reach the hub), graded
# with math-verify. One node of 8 GPUs: 4 trainer ranks (FSDP2, bf16 compute, fp32 master weights)
# and 4 vLLM engines, one GPU each:
#   torchrun --nproc_per_node=4 train.py config/qwen_math.py
# The split: a step is 60 groups x 16 answers of ~300 tokens (~300k tokens with the prompts). The
# trainer, measured on one H100 at this model's shape (bench.py --trainer, results log): 35k
# tokens/s with checkpointing and compiled layers (0.34 MFU), so 4 ranks take ~2.1 s. The engines,
# on paper: an H100 makes ~30k tokens/s at this batch, so 4 take ~2.4 s. The old split (5 + 3)
# fit a trainer at 10% MFU.
model = "Qwen/Qwen2.5-1.5B-Instruct"
task = "gsm8k"
data_path = "openai/gsm8k"  # the hub dataset: train split to train, test split to evaluate
out_dir = "out/qwen_math"
max_steps = 200
batch_groups = 60  # 15 groups per trainer rank
group_size = 16
max_new_tokens = 1024
temperature = 1.0
lr = 1e-6
max_staleness = 2
drop_flat = True
eval_every = 20
eval_n = 500
rollout_engines = 4
rollout_seqs = 720  # per engine: the budget, (2 + 1) x 60 groups x 16, over 4 engines
grader_workers = 4  # per engine: ~1,400 math-verify grades/s, ~14x its answers (results log)
# "float16" for both: 8x less logprob mismatch on SmolLM2 on CPU, the loss scaled (results
# log); not yet run on a GPU
rollout_dtype = "bfloat16"
trainer_dtype = "bfloat16"
# ~75k tokens per rank a step in 3 micro-batches; with checkpointing a token keeps ~0.15 MB
micro_batch_tokens = 32768
activation_checkpointing = True
max_model_len = 2048
gpu_memory_utilization = 0.85  # the staging copy (3 GB in bf16) is counted in it
# rank 0's GPU also holds the senders' copy of the weights (3 GB; 6 GB while an engine is behind)
enforce_eager = False
timeout_s = 600
