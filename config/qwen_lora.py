# LoRA on one 80 GB GPU: Qwen2.5-7B-Instruct frozen in bf16, a rank-32 adapter on every linear layer
# trained, the trainer and one vLLM engine sharing the GPU (colocate). Sized on paper, not run:
#   trainer: the base loaded straight in bf16 and kept out of FSDP (loss.shard), so held once:
#     7.6B x 2 B = 15.2 GB, with no gradient or AdamW state (managed by FSDP it would also be
#     gathered into a second copy kept all step: 2 x 15.2 GB, past the GPU beside vLLM); the
#     adapter, 28 layers x 32 x (q 7,168 + k 4,096 + v 4,096 + o 7,168 + gate, up, down
#     3 x 22,528) = 81M parameters: fp32 weights, gradients, AdamW 1.3 GB, its gathered bf16 copy
#     0.16 GB; checkpointed layer inputs, 16,384 tokens x 3,584 x 2 B x 28 = 3.3 GB; one layer's
#     recompute ~3 GB; the fp32 output layer, 1,024 rows at a time, ~2 GB: ~25 GB (goal: 30 GiB,
#     checked by `bench.py --trainer --shape=7b --lora_rank=32 --checkpointing=1 --max_gib=30`)
#   vLLM, gpu_memory_utilization 0.55 of 80 GB = 44 GB: the base 15.2 GB, the adapter's slot
#     0.16 GB, activations and CUDA graphs ~3 GB, KV cache ~25 GB (57 KB a token: 440k tokens,
#     for (512 + 500) sequences of up to 1,024)
#   a push: the adapter in bf16, 162 MB (1% of the model), through the shared copy
#   torchrun --nproc_per_node=1 train.py config/qwen_lora.py
model = "Qwen/Qwen2.5-7B-Instruct"
task = "gsm8k"
data_path = "openai/gsm8k"
out_dir = "out/qwen_lora"
max_steps = 200
batch_groups = 16
group_size = 16
max_new_tokens = 512
temperature = 1.0
lr = 1e-5  # LoRA's best rate is ~10x full fine-tuning's (results log)
lora_rank = 32
lora_alpha = 32
lora_targets = "all-linear"
max_staleness = 1
eval_every = 20
eval_n = 500
colocate = True
rollout_seqs = 512  # the budget: (1 + 1) x 16 groups x 16
grader_workers = 4
# "float16" for both: 8x less logprob mismatch on SmolLM2 on CPU, the loss scaled (results
# log); not yet run on a GPU
rollout_dtype = "bfloat16"
trainer_dtype = "bfloat16"
activation_checkpointing = True
micro_batch_tokens = 16384
max_model_len = 1024
gpu_memory_utilization = 0.55
enforce_eager = False
timeout_s = 600
