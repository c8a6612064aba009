# Tiny random model (build it with `python prepare.py tiny`): exercises the whole pipeline in
# seconds.
# It learns nothing useful; tests use it to check mechanics (sync, staleness, metrics, processes).
model = "data/tiny"
out_dir = "out/tiny"
max_steps = 6
batch_groups = 4
group_size = 4
max_new_tokens = 24
temperature = 1.0
lr = 1e-3
max_staleness = 1
drop_flat = False  # a random model rarely gets a reward: keep flat groups so steps have data
eval_every = 3
eval_n = 20
rollout_seqs = 32
max_model_len = 128
kv_cache_gb = 1
timeout_s = 60
