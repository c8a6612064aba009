# The agent demo (`make agent`): SmolLM2-135M-Instruct (offline, `python prepare.py smollm2`) learns
# to call a calculator on word problems (products of a 4-digit and a 2-3-digit number), on 2 cores.
# --max_turns=1: the same questions without the calculator (the baseline).
model = "data/smollm2-135m"
task = "calculator"
out_dir = "out/smollm_calc"
max_steps = 9
max_turns = 3  # call, then answer; one more call allowed
batch_groups = 4  # half the arithmetic demo's: twice the steps in its time
group_size = 8
max_new_tokens = 48  # a call, its result and the answer take ~35
temperature = 0.7
lr = 3e-5
max_staleness = 1
drop_flat = True
eval_every = 3
eval_n = 100  # a binomial standard error of ~0.05
rollout_seqs = 128
rollout_dtype = "float32"  # see smollm_cpu.py
trainer_dtype = "float32"
rollout_cpus = "1"
micro_batch_tokens = 1024  # see smollm_cpu.py
max_model_len = 320  # the worked example makes the prompt ~110 tokens
kv_cache_gb = 2
timeout_s = 300
