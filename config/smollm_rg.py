# SmolLM2-135M-Instruct (offline, `python prepare.py smollm2`) on a reasoning-gym task on 2 cores
# (`pip install reasoning-gym==0.1.25`): how often does a letter appear in a line of text. Held-out
# accuracy at the start (greedy, these 200 problems): 0.28, mostly by answering 1 (the answer to
# 35% of them); more takes counting. Answers are a few tokens; a prompt is ~180.
model = "data/smollm2-135m"
task = "rg:letter_counting"
out_dir = "out/smollm_rg"
max_steps = 20
batch_groups = 8
group_size = 8
max_new_tokens = 64
temperature = 0.7
lr = 2e-5
max_staleness = 1
drop_flat = True
eval_every = 5
eval_n = 200  # a binomial standard error of ~0.03 at these accuracies
rollout_seqs = 128
rollout_dtype = "float32"  # see smollm_cpu.py
trainer_dtype = "float32"
rollout_cpus = "1"
micro_batch_groups = 2
max_model_len = 320
kv_cache_gb = 2
timeout_s = 300
