"""Tiny GGUF files written as llama.cpp's converter writes them, with the `gguf` package's writer: a tiny Hugging
Face checkpoint's hyperparameters, its tokenizer as GGUF metadata (byte-level BPE, or a sentencepiece-style
vocabulary as Llama 2 and Mistral files carry), and its 2-D weights as Q8_0 (the rest F32)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# A Mistral-style template for the sentencepiece files (their tokenizer knows no <|im_start|>)
INST_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                 "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def llama_cpp_order(w: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows as llama.cpp's converter stores them for its rotary layout (the inverse of what the reader undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, model, tokenizer: Path | None = None, name: str | None = None,
               spm: bool = False, tokens: int | None = None) -> dict[str, np.ndarray]:
    """`model`'s tensors as a GGUF of `arch`; returns the HF tensors. `tokenizer`: the HF folder whose tokenizer
    (byte-level BPE) goes into the metadata, or with `spm` a sentencepiece-style vocabulary trained on the tiny
    corpus instead; `tokens`: pad the token list to this many with [PAD] tokens, as llama.cpp pads it to the
    embedding's rows. `name`: general.name."""
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    if name:
        writer.add_name(name)
    _hyperparameters(writer, arch, c)
    if spm:
        _spm_vocab(writer, tokens)
    elif tokenizer is not None:
        _bpe_vocab(writer, tokenizer, "qwen2" if arch.startswith("qwen") else "llama-bpe", tokens)
    hf = _tensors(writer, arch, model)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def _hyperparameters(writer, arch: str, c) -> None:
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    writer.add_vocab_size(c.vocab_size)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _tensors(writer, arch: str, model) -> dict[str, np.ndarray]:
    import gguf

    from specrt.export.weights import _gguf_names

    c = model.config
    hf = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    for name, hf_name in _gguf_names(c.num_hidden_layers).items():
        if hf_name not in hf:
            continue
        w = hf[hf_name]
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            w = llama_cpp_order(w, c.num_attention_heads if ".q_proj." in hf_name else c.num_key_value_heads)
        if w.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, w)
    return hf


def _padded(tokens: list, types: list, scores: list | None, n: int | None) -> None:
    for i in range(len(tokens), n or 0):
        tokens.append(f"[PAD{i}]")
        types.append(5)  # UNUSED
        if scores is not None:
            scores.append(-1000.0)


def _bpe_vocab(writer, folder: Path, pre: str, n: int | None) -> None:
    """Tokens in id order, the added special ones marked CONTROL; merges, special ids and the chat template as the
    gguf package's SpecialVocab reads them from the folder."""
    import gguf

    tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    special = {t["content"] for t in tok["added_tokens"] if t.get("special")}
    by_id = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    types = [3 if t in special else 1 for t in tokens]
    _padded(tokens, types, None, n)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def _spm_vocab(writer, n: int | None) -> None:
    """A sentencepiece-style vocabulary (<unk>, <s>, </s>, the 256 byte tokens, then pieces with falling scores),
    no merges (transformers derives them from the scores), as Llama 2 and Mistral GGUFs hold."""
    from tokenizers import SentencePieceBPETokenizer

    from specrt.export.tiny import CORPUS

    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(CORPUS * 4, vocab_size=80, show_progress=False)
    pieces = [t for t, _ in sorted(trained.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    _padded(tokens, types, scores, n)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(INST_TEMPLATE)
