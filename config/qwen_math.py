# The GPU recipe: Qwen2.5-1.5B-Instruct on GSM8K, graded with math-verify. One node of 8 GPUs: 7 trainer ranks
# (FSDP2, bf16 compute, fp32 master weights) + vLLM on the 8th GPU. See README "GPU recipe" for the set-up commands.
#   torchrun --nproc_per_node=7 train.py config/qwen_math.py
model = "data/qwen2.5-1.5b-instruct"  # huggingface-cli download Qwen/Qwen2.5-1.5B-Instruct --local-dir <this>
task = "gsm8k"
data_path = "data/gsm8k/train.jsonl"  # see README: written once from the openai/gsm8k hub dataset
eval_path = "data/gsm8k/test.jsonl"
out_dir = "out/qwen_math"
max_steps = 200
batch_groups = 56  # 8 groups per trainer rank
group_size = 16
max_new_tokens = 1024
temperature = 1.0
lr = 1e-6
max_staleness = 2
drop_flat = True
eval_every = 20
eval_n = 500
rollout_groups = 128
rollout_dtype = "bfloat16"
trainer_dtype = "bfloat16"
micro_batch_groups = 1
max_model_len = 2048
gpu_memory_utilization = 0.85
enforce_eager = False
bucket_mb = 512
timeout_s = 600
