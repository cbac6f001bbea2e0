"""The checkpoint's tokenizer: byte-level BPE trained on the corpus, with ChatML special tokens,
and the ``tokenizer_config.json`` / ``special_tokens_map.json`` transformers reads beside it.

It depends only on the vocabulary size (not on the seed or the arch).
"""

from __future__ import annotations

from typing import Any

from layerscope.engine.models.create.corpus import corpus_text, pseudo_text

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2.
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# GPT-2/Qwen-style split: contractions, letter runs, single digits, punctuation, whitespace.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _train_bpe(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # Same pre-tokenization as transformers' Qwen2Tokenizer, which AutoTokenizer (v5) forces
    # for model_type "qwen2" and which rebuilds the pipeline instead of reading ours. No
    # normalizer though (Qwen2Tokenizer adds NFC), so tokenizer.json round-trips any text.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tokenizer(vocab_size: int):
    """Byte-level BPE (``tokenizers.Tokenizer``) with exactly ``vocab_size`` entries.

    Trains on the bundled corpus; when that runs out of merges, retrains with
    deterministic pseudo-word filler appended (growing it until the target is reached).
    Special tokens get ids 0 (<|endoftext|>), 1 (<|im_start|>), 2 (<|im_end|>).
    """
    base = 256 + len(SPECIAL_TOKENS)
    if vocab_size < base + 1:
        raise ValueError(f"vocab_size must be > {base} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    corpus = corpus_text()
    paragraphs = [p for p in corpus.split("\n\n") if p.strip()]
    n_pseudo = 0
    while True:
        texts = paragraphs + ([pseudo_text(n_pseudo)] if n_pseudo else [])
        tok = _train_bpe(texts, vocab_size)
        got = tok.get_vocab_size()
        if got >= vocab_size:
            return tok
        if n_pseudo > 64 * vocab_size:  # pragma: no cover - cannot happen with the filler above
            raise RuntimeError(f"could not train a {vocab_size}-entry tokenizer (got {got})")
        # Roughly one new vocab entry per pseudo-word; overshoot so a retry is rare.
        n_pseudo = max(2 * n_pseudo, int(1.25 * (vocab_size - got)) + 256)


def _added_token(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}


def tokenizer_files(tok, model_max_length: int) -> dict[str, Any]:
    """File name -> JSON of the tokenizer files transformers reads beside ``tokenizer.json``."""
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tokenizer_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(ids[t]): _added_token(t) for t in SPECIAL_TOKENS},
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": EOS_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    special_tokens_map = {
        "additional_special_tokens": [IM_START, IM_END],
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
    }
    return {"tokenizer_config.json": tokenizer_config, "special_tokens_map.json": special_tokens_map}

