# The GPU recipe on one 80 GB GPU: the trainer and one vLLM engine share it (colocate); the weights
# pass through a staging copy shared by CUDA IPC (3 GB in bf16) instead of a broadcast. vLLM takes
# gpu_memory_utilization of the GPU (weights + KV cache), the trainer the rest (fp32 weights,
# gradients and AdamW of 1.5B parameters: ~25 GB, the staging copy, activations).
#   torchrun --nproc_per_node=1 train.py config/qwen_1gpu.py
model = "Qwen/Qwen2.5-1.5B-Instruct"
task = "gsm8k"
data_path = "openai/gsm8k"
out_dir = "out/qwen_1gpu"
max_steps = 200
batch_groups = 16
group_size = 16
max_new_tokens = 512
temperature = 1.0
lr = 1e-6
max_staleness = 1
eval_every = 20
eval_n = 500
colocate = True
rollout_seqs = 512  # the budget: (1 + 1) x 16 groups x 16
grader_workers = 4  # per engine: ~1,400 math-verify grades/s, ~14x its answers (results log)
# "float16" for both: 8x less logprob mismatch on SmolLM2 on CPU, the loss scaled (results
# log); not yet run on a GPU
rollout_dtype = "bfloat16"
trainer_dtype = "bfloat16"
activation_checkpointing = True
# measured at this shape on one H100 (bench.py --trainer, results log): with checkpointing and
# compiled layers 0.34 MFU; uncompiled, 32k tokens a micro-batch ran 6% faster than 16k, 33 GB
# at its peak (+0.15 MB a token): a step, ~80k tokens, in 3 micro-batches, beside vLLM's 0.4
micro_batch_tokens = 32768
max_model_len = 1024
# KV cache for the training sequences and an eval: (512 + 500) x ~710 tokens x 28 KB = 20 GB
gpu_memory_utilization = 0.4
enforce_eager = False
timeout_s = 600
