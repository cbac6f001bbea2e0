"""Tokenizer loading and incremental detokenization for stop strings and streaming."""

from __future__ import annotations

from pathlib import Path

from layerscope.engine.models.checkpoint import CheckpointError, check_model_dir


def load_tokenizer(model_dir: str | Path):
    """A transformers fast tokenizer from the model directory (offline)."""
    from transformers import AutoTokenizer

    check_model_dir(model_dir, need_config=False)  # a missing path: say so, not a hub-id error
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - turn any loader failure into one clear error
        raise CheckpointError(f"{model_dir}: cannot load tokenizer ({e})") from None


class Detokenizer:
    """Decodes a request's output ids incrementally; text is re-decoded over a short
    window so multi-byte characters split across tokens come out whole."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        # the Rust tokenizer directly (~2x cheaper per call) unless transformers post-processes
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=True)
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self.stop = stop
        self.text = ""
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids before this are settled
        self._read_offset = 0

    def append(self, token_id: int) -> str:
        """Add one token; returns the new text delta (may be empty while a character is partial)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def find_stop(self, delta_len: int) -> int | None:
        """If a stop string appeared in the text (searching the new part), return the
        index where the text must be cut."""
        if not self.stop or not delta_len:
            return None
        longest = max(len(s) for s in self.stop)
        start = max(0, len(self.text) - delta_len - longest + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best):
                best = i
        return best
