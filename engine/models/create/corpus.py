"""The text a model's tokenizer is trained on: the bundled ``corpus.txt``, and seeded pseudo-word
filler for vocabularies larger than the corpus can supply merges for."""

from __future__ import annotations

import random
from importlib import resources


def corpus_text() -> str:
    """The bundled corpus (package data of ``layerscope.engine.models``)."""
    return resources.files("layerscope.engine.models").joinpath("corpus.txt").read_text(encoding="utf-8")


_ONSETS = (
    "", "b", "br", "c", "ch", "cl", "d", "dr", "f", "fl", "fr", "g", "gl", "gr", "h", "j", "k", "l",
    "m", "n", "p", "pl", "pr", "qu", "r", "s", "sh", "sk", "sl", "sp", "st", "str", "t", "th", "tr",
    "v", "w", "wh", "y", "z",
)
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "oo", "ou", "y")
_CODAS = ("", "", "", "b", "ck", "d", "ft", "g", "l", "ll", "m", "n", "nd", "ng", "nk", "nt", "p",
          "r", "rd", "rn", "s", "ss", "st", "t", "th", "x")


def pseudo_text(n_words: int) -> str:
    """Deterministic filler of syllable-built pseudo-words, Zipf-ish repeated, in sentences.

    Only used when the bundled corpus cannot supply enough merges for the requested vocab.
    """
    rng = random.Random(0x5EED_70C)
    lexicon = []
    seen = set()
    while len(lexicon) < n_words:
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 4)))
        if w not in seen:
            seen.add(w)
            lexicon.append(w)
    words = []
    for rank, w in enumerate(lexicon):
        words.extend([w] * (2 + 64 // (rank + 1)))
    rng.shuffle(words)
    out, i = [], 0
    while i < len(words):
        k = rng.randint(4, 14)
        sent = words[i : i + k]
        i += k
        sent[0] = sent[0].capitalize()
        out.append(" ".join(sent) + rng.choice((".", ".", ".", "?", "!", ",")))
    return "\n".join(" ".join(out[j : j + 6]) for j in range(0, len(out), 6))
