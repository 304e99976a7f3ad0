"""Tiny draft/target checkpoints made locally: the default pair before real weights, and test models.

`make_tiny_pair(out)` writes two Hugging Face folders (random weights, a real byte-level BPE
tokenizer trained with `tokenizers` on a little Python code). The draft is the target's first
layers with the target's embeddings and output matrix (a layer-skip draft), so the two agree on
many tokens but not all: speculative decoding shows partial acceptance, as with a real pair.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

CORPUS = [
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n"
    "    left = [x for x in xs[1:] if x < pivot]\n    right = [x for x in xs[1:] if x >= pivot]\n"
    "    return quicksort(left) + [pivot] + quicksort(right)\n",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
    "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n",
    "import numpy as np\nprint('hello world')\nfor i in range(10):\n    print(i * i)\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and verifies them.",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def make_word_tokenizer(words: list[str]):
    """A whitespace word-level tokenizer: a tiny vocabulary for statistical tests."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIAL + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return tok


def _save_tokenizer(tok, folder: Path):
    tok.save(str(folder / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def make_model(folder, tok, model_type="qwen2", layers=4, vocab_size=None, hidden=64, heads=4, kv_heads=2,
               init=0.3, seed=0, donor=None, damp_from=None, damp=0.15):
    """Write a random-weight HF checkpoint. With `donor`, copy its embeddings, output matrix and first layers.

    `damp_from`: scale the residual writes of layers from this index on by `damp`, so that a draft made
    of the first layers predicts the target fairly well (partial, not total, agreement).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    eos = tok.token_to_id("<|im_end|>")
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size or tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        initializer_range=init,
        tie_word_embeddings=False,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=tok.token_to_id("<|endoftext|>"),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # special tokens get logit 0: rare but possible, so greedy text runs long
        model.lm_head.weight[: len(SPECIAL)] = 0.0
    if damp_from is not None:
        with torch.no_grad():
            for layer in model.model.layers[damp_from:]:
                layer.self_attn.o_proj.weight.mul_(damp)
                layer.mlp.down_proj.weight.mul_(damp)
    if donor is not None:
        with torch.no_grad():
            n = cfg.vocab_size
            model.model.embed_tokens.weight.copy_(donor.model.embed_tokens.weight[:n])
            model.lm_head.weight.copy_(donor.lm_head.weight[:n])
            model.model.norm.load_state_dict(donor.model.norm.state_dict())
            for mine, theirs in zip(model.model.layers, donor.model.layers):
                mine.load_state_dict(theirs.state_dict())
    model.save_pretrained(folder)
    model.generation_config.eos_token_id = eos
    model.generation_config.save_pretrained(folder)
    _save_tokenizer(tok, folder)
    return model


def make_tiny_pair(out, model_type: str = "qwen2", target_layers: int = 4, draft_layers: int = 2,
                   target_vocab: int = 384, draft_vocab: int = 352) -> tuple[Path, Path]:
    """Write `out/target` and `out/draft`. The vocab sizes differ by padding rows, as Qwen2.5's do."""
    out = Path(out)
    tok = make_tokenizer()
    target = make_model(out / "target", tok, model_type, target_layers, vocab_size=target_vocab,
                        damp_from=draft_layers)
    make_model(out / "draft", tok, model_type, draft_layers, vocab_size=draft_vocab, seed=1, donor=target)
    return out / "target", out / "draft"


if __name__ == "__main__":
    print(*make_tiny_pair(sys.argv[1] if len(sys.argv) > 1 else "tiny-pair"))
