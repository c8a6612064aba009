# The CPU demo with LoRA: config/smollm_cpu.py's run, training a rank-16 adapter on every linear
# layer (4.9M parameters) with the 135M base frozen; a push moves the adapter alone, 3.6% of the
# model's bytes.
model = "data/smollm2-135m"
task = "arithmetic"
out_dir = "out/smollm_lora"
max_steps = 10
batch_groups = 8
group_size = 8
max_new_tokens = 64
temperature = 0.7
lr = 3e-4  # 15x the full demo's: 2e-4 learned less in the same time (results log)
lora_rank = 16
lora_alpha = 32
lora_targets = "all-linear"
max_staleness = 1
drop_flat = True
eval_every = 5
eval_n = 200
rollout_seqs = 128
rollout_dtype = "float32"
trainer_dtype = "float32"
rollout_cpus = "1"
micro_batch_tokens = 1024
max_model_len = 256
kv_cache_gb = 2
timeout_s = 300
