"""A tiny random-weight Llama and a byte-level BPE tokenizer, built locally (no hub access).

Run with an engine's Python (it needs ``torch``, ``transformers`` and ``tokenizers``):
``python tests/real_engines/model.py OUT_DIR``. Takes a few seconds and ~3 MB. Greedy decoding of
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


if __name__ == "__main__":
    build(Path(sys.argv[1]))
