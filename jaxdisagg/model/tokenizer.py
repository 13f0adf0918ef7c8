"""Tokenizers: `tokenizers` from a checkpoint (tokenizer.json, or a GGUF's
`tokenizer.ggml.*` metadata), or built-in bytes.

All give the same small interface: `encode(text) -> ids` (BOS prepended when the
checkpoint asks for it), `decode(ids) -> text` (special tokens dropped), `bos_id`,
`eos_ids`, `vocab_size`, and `chat_template` (None without one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from jaxdisagg.model.chat import ChatTemplate
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
    chat_template = None

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
    """A `tokenizers.Tokenizer` from tokenizer.json (with tokenizer_config.json and
    chat_template.jinja beside it when present), or built from a GGUF's metadata."""

    def __init__(self, source, config: LlamaConfig, *, add_bos: bool | None = None,
                 chat_template: ChatTemplate | None = None):
        from tokenizers import Tokenizer as _Tok

        if isinstance(source, _Tok):
            self._tok = source
        else:
            path = Path(source)
            try:
                self._tok = _Tok.from_file(str(path))
            except Exception as e:  # the library raises a bare Exception on bad JSON
                raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from e
        self.bos_id = config.bos_token_id
        self.eos_ids = config.eos_token_ids
        self.vocab_size = config.vocab_size
        # None: the file's post-processor decides, and BOS is added if it did not
        # (Llama 2 and 3 add it there); False: never (SmolLM2's GGUF says so).
        self.add_bos = add_bos
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, directory: str | Path, config: LlamaConfig) -> HFTokenizer:
        """tokenizer.json, plus tokenizer_config.json / chat_template.jinja if present."""
        directory = Path(directory)
        extra = {}
        cfg_file = directory / "tokenizer_config.json"
        if cfg_file.exists():
            try:
                extra = json.loads(cfg_file.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_file}: invalid JSON ({e})") from None
        tok = cls(directory / "tokenizer.json", config, add_bos=extra.get("add_bos_token"))
        source = extra.get("chat_template")
        jinja = directory / "chat_template.jinja"
        if jinja.exists():
            source = jinja.read_text()
        if isinstance(source, list):  # several named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if source:
            tok.chat_template = ChatTemplate(source, tok.special_tokens(extra))
        return tok

    @classmethod
    def from_gguf(cls, spec, config: LlamaConfig) -> HFTokenizer:
        """A byte-level BPE tokenizer from `tokenizer.ggml.*`, built as transformers
        builds it from the same file (so the ids agree)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

        if spec.model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model: {spec.model!r} tokenizers are not "
                             "supported yet (byte-level BPE, 'gpt2', is)")
        vocab = {t: i for i, t in enumerate(spec.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in spec.merges]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                                   continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=spec.add_space_prefix)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        # Control tokens (type 3) are special; user-defined ones (type 4) match verbatim.
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(spec.tokens, spec.token_types, strict=False)
                                if kind == 3])
        tok.add_tokens([AddedToken(t, normalized=False)
                        for t, kind in zip(spec.tokens, spec.token_types, strict=False)
                        if kind == 4])
        out = cls(tok, config, add_bos=spec.add_bos)
        if spec.chat_template:
            names = {"bos_token": spec.bos_id, "eos_token": spec.eos_id,
                     "unk_token": spec.unk_id, "pad_token": spec.pad_id}
            out.chat_template = ChatTemplate(spec.chat_template, {
                k: spec.tokens[i] for k, i in names.items()
                if i is not None and 0 <= i < len(spec.tokens)})
        return out

    def special_tokens(self, extra: dict) -> dict[str, str | None]:
        """bos/eos/unk/pad token strings for templates: tokenizer_config.json's, else ours."""
        def text(v):
            return v.get("content") if isinstance(v, dict) else v

        out = {k: text(extra.get(k)) for k in ("bos_token", "eos_token", "unk_token",
                                               "pad_token")}
        if out["bos_token"] is None and self.bos_id is not None:
            out["bos_token"] = self._tok.id_to_token(self.bos_id)
        if out["eos_token"] is None and self.eos_ids:
            out["eos_token"] = self._tok.id_to_token(self.eos_ids[0])
        return out

    def to_files(self, directory: Path) -> None:
        """tokenizer.json and tokenizer_config.json (chat template, BOS rule) for `from_dir`."""
        self._tok.save(str(directory / "tokenizer.json"))
        cfg = {"add_bos_token": self.add_bos}
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template.source
            cfg.update(self.chat_template.special_tokens)
        (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if self.add_bos is False:
            add_bos = False
        # The file's own post-processor may already add BOS (Llama 2 and 3 do);
        # add it ourselves only where it did not, so BOS appears exactly once.
        ids = self._tok.encode(text, add_special_tokens=add_bos).ids
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


def load_tokenizer(checkpoint_dir: str | Path | None, config: LlamaConfig) -> Tokenizer | None:
    """tokenizer.json of a checkpoint (None if it has none); bytes for the presets."""
    if checkpoint_dir is None:
        return ByteTokenizer(config.vocab_size)
    path = Path(checkpoint_dir)
    return HFTokenizer.from_dir(path, config) if (path / "tokenizer.json").exists() else None


class IncrementalDecoder:
    """Turns a growing list of ids into text deltas for streaming, in O(1) per token.

    Only a window is decoded each time: the ids from `prefix` (the start of the last
    emitted token run) to the end. The text of `ids[prefix:read]` was emitted already;
    what the window adds past it is new. Starting the window at an emitted token keeps
    tokenizers that drop a leading space on the first token of a decode from dropping
    it here. A window ending in U+FFFD is held back: a multi-byte character is usually
    still incomplete, and the offsets only move on once it decodes cleanly.

    Bytes that never decode (a random model's, or a broken byte-fallback run) would
    hold the window open for good and make every token cost O(output). So once more
    than `HOLD` ids are pending, the run is cut before its last `KEEP` ids that carry
    text (an id whose own decode is empty, a skipped special, carries no bytes). A
    character not yet complete has at most 3 bytes in the window (UTF-8 has <= 4 a
    character, a text-carrying id at least 1), so it lies in the kept tail. One already
    complete that the cut would split shows up as the released text not being a
    prefix of the window's; the cut then moves back until it is.
    """

    HOLD, KEEP = 8, 3

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # ids before this are emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        done = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            if len(self.ids) - self.read <= self.HOLD:
                return ""
            cut = self._cut(text)
            if cut == self.read:
                return ""
            head = self.tokenizer.decode(self.ids[self.prefix:cut])
            self.prefix, self.read = self.read, cut
            return head[len(done):]
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]

    def _cut(self, text: str) -> int:
        """Where the pending run may be released up to (`read`: nowhere)."""
        cut, kept = len(self.ids), 0
        while cut > self.read and kept < self.KEEP:
            cut -= 1
            kept += bool(self.tokenizer.decode(self.ids[cut:cut + 1]))
        if kept < self.KEEP:  # fewer text ids than KEEP: keep from the first of them
            while cut < len(self.ids) and not self.tokenizer.decode(self.ids[cut:cut + 1]):
                cut += 1
        while cut > self.read and not text.startswith(
                self.tokenizer.decode(self.ids[self.prefix:cut])):
            cut -= 1
        return cut

    def flush(self) -> str:
        done = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(done):]
