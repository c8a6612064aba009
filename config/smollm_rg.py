# SmolLM2-135M-Instruct (offline, `python prepare.py smollm2`) on a reasoning-gym task on 2 cores
# (`pip install reasoning-gym==0.1.25`): does a conclusion follow from two statements (Yes or No).
# Held-out accuracy (greedy, these 200 problems): 0.33 at the start, 0.665 by version 4 (~3.5 min of
# training, one run). 133 of the 200 answers are Yes, so 0.665 is what answering Yes scores: a model
# this small learns the answer's prior first (results log: the other tasks tried, what each did).
model = "data/smollm2-135m"
task = "rg:syllogism"
out_dir = "out/smollm_rg"
max_steps = 12
batch_groups = 8
group_size = 8
max_new_tokens = 64
temperature = 1.0  # short answers: at 0.7 most groups are flat
lr = 2e-5
max_staleness = 1
drop_flat = False  # once it answers Yes, nearly every group is flat: dropping them starves the run
eval_every = 4
eval_n = 200  # a binomial standard error of ~0.03 at these accuracies
rollout_seqs = 128
rollout_dtype = "float32"  # see smollm_cpu.py
trainer_dtype = "float32"
rollout_cpus = "1"
micro_batch_tokens = 1024  # see smollm_cpu.py
max_model_len = 320
kv_cache_gb = 2
timeout_s = 300
