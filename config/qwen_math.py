# The GPU recipe: Qwen2.5-1.5B-Instruct on GSM8K (hub ids; the machine must reach the hub), graded
# with math-verify. One node of 8 GPUs: 5 trainer ranks (FSDP2, bf16 compute, fp32 master weights)
# + 3 vLLM engines, one GPU each, so that neither side idles most of the time (README "GPU recipe":
# the arithmetic):
#   torchrun --nproc_per_node=5 train.py config/qwen_math.py
model = "Qwen/Qwen2.5-1.5B-Instruct"
task = "gsm8k"
data_path = "openai/gsm8k"  # the hub dataset: train split to train, test split to evaluate
out_dir = "out/qwen_math"
max_steps = 200
batch_groups = 60  # 12 groups per trainer rank
group_size = 16
max_new_tokens = 1024
temperature = 1.0
lr = 1e-6
max_staleness = 2
drop_flat = True
eval_every = 20
eval_n = 500
rollout_engines = 3
rollout_seqs = 960  # per engine: the budget, (2 + 1) x 60 groups x 16, over 3 engines
grader_workers = 4  # per engine: ~1,400 math-verify grades/s, ~14x its answers (results log)
rollout_dtype = "bfloat16"
trainer_dtype = "bfloat16"
micro_batch_tokens = 16384
activation_checkpointing = True
max_model_len = 2048
gpu_memory_utilization = 0.85
enforce_eager = False
timeout_s = 600
