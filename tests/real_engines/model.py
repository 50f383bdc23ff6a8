"""A tiny random-weight Llama and a byte-level BPE tokenizer, built locally (no hub access).

Run with an engine's Python (it needs ``torch``, ``transformers`` and ``tokenizers``):
``python tests/real_engines/model.py OUT_DIR`` (``--lora OUT_DIR BASE_DIR``: a LoRA adapter of
it). Takes a few seconds and ~3 MB. Greedy decoding of
fixed random weights is deterministic, so a co-located engine and a PD pair must agree.
"""

from __future__ import annotations

import glob
import sys
from pathlib import Path

VOCAB_SIZE = 4096
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def training_files() -> list[str]:
    """Local text every Debian machine has: licence texts and some stdlib sources."""
    files = sorted(glob.glob("/usr/share/common-licenses/*"))[:20]
    files += sorted(glob.glob(f"{Path(glob.__file__).parent}/json/*.py"))
    return [f for f in files if Path(f).is_file()]


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train(training_files(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)


def build_lora(out: Path, base: Path, rank: int = 8) -> None:
    """A random LoRA adapter of the tiny model (PEFT's files: ``adapter_config.json`` and
    ``adapter_model.safetensors``) on its attention's q and v projections."""
    import json

    import torch
    from safetensors.torch import save_file

    torch.manual_seed(1)
    hidden = 128
    tensors = {}
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = (torch.randn(rank, hidden) * 0.1).bfloat16()
            tensors[f"{name}.lora_B.weight"] = (torch.randn(hidden, rank) * 0.1).bfloat16()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "v_proj"],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": str(base),
    }
    (out / "adapter_config.json").write_text(json.dumps(config))


if __name__ == "__main__":
    if sys.argv[1] == "--lora":  # model.py --lora OUT BASE
        build_lora(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        build(Path(sys.argv[1]))
