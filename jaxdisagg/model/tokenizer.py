"""Tokenizers: `tokenizers` from a checkpoint's tokenizer.json, or built-in bytes.

Both give the same small interface: `encode(text) -> ids` (BOS prepended when the
model has one), `decode(ids) -> text` (special tokens dropped), `bos_id`,
`eos_ids`, `vocab_size`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from jaxdisagg.model.config import BYTE_BOS, BYTE_EOS, BYTE_PAD, LlamaConfig


class Tokenizer(Protocol):
    bos_id: int | None
    eos_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, then BOS/EOS/PAD; the random presets' vocabulary."""

    bos_id = BYTE_BOS
    eos_ids = (BYTE_EOS,)
    pad_id = BYTE_PAD

    def __init__(self, vocab_size: int):
        if vocab_size <= BYTE_PAD:
            raise ValueError(f"a byte-level vocabulary needs > {BYTE_PAD} ids, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([self.bos_id] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # Ids past the bytes (specials, and the unused tail a random model may still
        # emit) carry no text. Broken UTF-8 sequences decode to U+FFFD.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from tokenizer.json."""

    def __init__(self, path: str | Path, config: LlamaConfig):
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on bad JSON
            raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from e
        self.bos_id = config.bos_token_id
        self.eos_ids = config.eos_token_ids
        self.vocab_size = config.vocab_size

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        # The file's own post-processor may already add BOS (Llama 2 and 3 do);
        # add it ourselves only where it did not, so BOS appears exactly once.
        ids = self._tok.encode(text, add_special_tokens=add_bos).ids
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(checkpoint_dir: str | Path | None, config: LlamaConfig) -> Tokenizer | None:
    """tokenizer.json of a checkpoint (None if it has none); bytes for the presets."""
    if checkpoint_dir is None:
        return ByteTokenizer(config.vocab_size)
    path = Path(checkpoint_dir) / "tokenizer.json"
    return HFTokenizer(path, config) if path.exists() else None


class IncrementalDecoder:
    """Turns a growing list of ids into text deltas for streaming.

    Decodes the whole list each time and emits what is new, holding back a
    trailing U+FFFD: it usually means a multi-byte character is still incomplete.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        stable = len(text.rstrip("\ufffd"))
        delta = text[self.emitted:stable]
        self.emitted = max(self.emitted, stable)
        return delta

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        delta = text[self.emitted:]
        self.emitted = len(text)
        return delta
