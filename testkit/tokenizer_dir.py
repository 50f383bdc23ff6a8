"""A small Hugging Face tokenizer directory built locally, for workers and router alike.

``build_tokenizer_dir(path)`` trains a byte-level BPE (vocabulary ~2000) with the ``tokenizers``
library on text every Debian machine has (licence texts, a few stdlib sources), with the special
tokens ``<s>`` / ``</s>`` (BOS/EOS; ``add_special_tokens=True`` prepends ``<s>``, as Llama's
tokenizers do) and the chat markers ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|end|>``,
and writes ``tokenizer.json`` plus a ``tokenizer_config.json`` whose ``chat_template`` is
``CHAT_TEMPLATE``. Building takes about a second; an existing directory is reused as is.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "VOCAB_SIZE", "build_tokenizer_dir"]

VOCAB_SIZE = 2000
BOS, EOS = "<s>", "</s>"
SPECIAL_TOKENS = [BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_FILES = ("tokenizer.json", "tokenizer_config.json")


def _training_files() -> list[str]:
    licences = sorted(p for p in Path("/usr/share/common-licenses").glob("*") if p.is_file())
    stdlib = Path(json.__file__).parent
    sources = sorted(stdlib.glob("*.py")) + [Path(shutil.__file__), Path(tempfile.__file__)]
    files = [str(p) for p in licences[:12] + sources if p.is_file()]
    if not files:
        raise RuntimeError("no local text to train the test tokenizer on")
    return files


def _train() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(_training_files(), trainer)
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tokenizer


def build_tokenizer_dir(path: Path) -> Path:
    """``path`` holding ``tokenizer.json`` and ``tokenizer_config.json`` (built if missing)."""
    if all((path / name).is_file() for name in _FILES):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=path.parent))
    try:
        _train().save(str(staging / "tokenizer.json"))
        config = {
            "bos_token": BOS,
            "eos_token": EOS,
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": 8192,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        try:
            staging.rename(path)  # atomic: a concurrent builder's result wins
        except OSError:
            if not all((path / name).is_file() for name in _FILES):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
