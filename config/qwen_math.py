# The GPU recipe: Qwen2.5-1.5B-Instruct on GSM8K, graded with math-verify. One node of 8 GPUs: 7 trainer ranks
# (FSDP2, bf16 compute, fp32 master weights and gradient reduction) + vLLM on the 8th GPU. See README "GPU recipe".
#   torchrun --nproc_per_node=7 train.py config/qwen_math.py
#
# On paper (not measured: no vLLM where a GPU was available), per step of 56 groups x 16 completions, ~150 prompt
# and ~300 completion tokens each (GSM8K answers), 1.54e9 parameters:
#   generation  56 x 16 x 300 = 269k new tokens; one H100 decoding a 1.5B model in bf16 with ~900 sequences in
#               flight does roughly 10-20k tokens/s -> 15-25 s. This is the bottleneck: one vLLM engine feeds 7 trainers.
#   training    56 x (150 + 16 x 300) = 277k tokens x 6 x 1.54e9 FLOP = 2.6e15 FLOP; 7 H100s at 25-35% MFU of
#               989 TFLOP/s -> 1-1.5 s.
#   weight sync 3.1 GB of bf16 weights: gather from 7 FSDP shards + one NCCL broadcast over NVLink (~300 GB/s) ->
#               ~0.05 s of transfer, plus vLLM's reload (~0.5 s, a guess) while generation pauses.
#   memory      per trainer GPU: 24.6 GB of fp32 weights + grads + AdamW / 7 = 3.5 GB; activations of one group
#               (16 x 450 tokens) ~15 GB in bf16 with the fp32 log-softmax over a 152k vocabulary for 4.8k positions
#               (~3 GB); activation_checkpointing=True cuts the MLP share. vLLM: 3.1 GB weights + KV cache.
# So with this model the trainer GPUs idle most of the time: one vLLM engine is this design's limit (no data-parallel
# engines). max_staleness=2 lets generation run two versions ahead so that at least it never waits for the trainer.
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
