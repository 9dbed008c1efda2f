"""A small real tokenizer trained from text at hand, for the embedded demo and the tests.

Nothing can be downloaded here, so the demo and tests build their own byte-level BPE tokenizer (the
same family as Qwen2.5 / SmolLM2 / Llama-3) from the environment's text, with a ChatML chat template,
and save it as a normal Hugging Face tokenizer folder that ``AutoTokenizer.from_pretrained`` loads.
The tags ``<think>``, ``<action>`` … are ordinary text, not special tokens, exactly as with the real
models, so action masks are found through offsets the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

# the shipped sample trajectories (docs/FORMATS.md): text for a tokenizer that knows the benchmarks' words
SAMPLE_DATA = Path(__file__).resolve().parents[1] / "sample_data"

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def build_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 2048):
    """Train a byte-level BPE on ``texts`` and save it (tokenizer.json + config) into ``out_dir``.
    Returns the loaded ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|pad|>", unk_token=None, model_max_length=32768)
    fast.chat_template = CHATML_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast


def build_sample_tokenizer(out_dir: str | Path, vocab_size: int = 1024):
    """:func:`build_tokenizer` trained on the shipped sample data (``sapd/sample_data``): the tokenizer the
    tests and the benchmark scripts share."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(SAMPLE_DATA.glob("*.json*"))]
    return build_tokenizer(texts, out_dir, vocab_size=vocab_size)
