# The CPU demo: SmolLM2-135M-Instruct (offline, `python prepare.py smollm2`) learns "What is a + b?"
# on 2 cores.
model = "data/smollm2-135m"
task = "arithmetic"
out_dir = "out/smollm_cpu"
max_steps = 10
# groups with reward spread per step (about 14 prompts; flat ones are skipped before counting)
batch_groups = 8
group_size = 8
max_new_tokens = 64
temperature = 0.7
lr = 2e-5
max_staleness = 1
# all right or all wrong: no signal (--drop_flat=False keeps them in the token mean, unrun)
drop_flat = True
eval_every = 5
eval_n = 200  # a binomial standard error of ~0.035 at these accuracies
rollout_seqs = 128
# fp32 runs everywhere; "bfloat16" for both is faster only on CPUs with avx512_bf16 or AMX (without
# them bf16 matmuls are emulated, ~60x slower): grep -o 'avx512_bf16\|amx_bf16' /proc/cpuinfo
rollout_dtype = "float32"
trainer_dtype = "float32"
# vLLM on core 1, the trainer on core 0, and on core 1 too while vLLM waits (borrow_cpus)
rollout_cpus = "1"
micro_batch_tokens = 1024  # on CPU 1,024 trained faster than 4,096 (results log)
max_model_len = 256
kv_cache_gb = 2
timeout_s = 300
