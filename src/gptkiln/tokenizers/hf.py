"""``hf``: a Hugging Face model's own tokenizer (Llama 3, Qwen3, ...): its ``tokenizer.json`` run by
``tokenizers`` with ``tokenizer_config.json``'s special tokens, BOS/EOS and stop ids, giving the
ids ``transformers.AutoTokenizer`` gives."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gptkiln.errors import GptkilnError
from gptkiln.tokenizers.base import (
    BPE_FILE,
    HF_CONFIG_FILE,
    HF_EXTRA_FILES,
    META_FILE,
    Tokenizer,
    _unicode_to_bytes,
    byte_level_decoder,
)

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


def _eos_ids(value: Any) -> list[int]:
    """``eos_token_id`` of a config.json / generation_config.json: an int, a list or absent."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class HFTokenizer(Tokenizer):
    """A Hugging Face model's tokenizer (``tokenizer.json`` + ``tokenizer_config.json``), giving
    the ids and text ``transformers.AutoTokenizer`` gives on the same directory.

    - `encode` is ``AutoTokenizer.encode(text)``: added tokens (``<|eot_id|>``, ``<|im_end|>``)
      written in the text are recognized as HF recognizes them, and BOS (EOS) is added as
      tokenizer.json's post-processor says (Llama 3's puts ``<|begin_of_text|>`` first, Qwen3's
      adds none). ``transformers`` 5 reads no ``add_bos_token`` / ``add_eos_token`` from
      tokenizer_config.json when there is a tokenizer.json, and neither does this.
      `encode_templated` adds nothing (a chat template's text holds its own), as
      ``apply_chat_template(tokenize=True)``.
    - `decode` keeps special tokens (HF's default) and cleans up spaces only where HF does
      (``clean_up_tokenization_spaces`` on a model other than BPE).
    - ``eot_id`` is the EOS of tokenizer_config.json (else config.json's first); `stop_ids` are
      every EOS id of tokenizer_config.json, config.json and generation_config.json.

    Args:
        source: the text of tokenizer.json.
        files: the contents of the directory's files by name (tokenizer_config.json and those of
            `HF_EXTRA_FILES` present; config.json's bos/eos ids), kept to save them again.
    """

    kind = "hf"

    def __init__(self, source: str, files: dict[str, Any]) -> None:
        from tokenizers import Tokenizer as HFTok

        self._source, self.files = source, files
        config = files.get(HF_CONFIG_FILE) or {}
        model_config = files.get("config.json") or {}
        self.special_tokens: dict[str, str] = {}  # bos_token, eos_token, ... as transformers'
        for named in (files.get("special_tokens_map.json") or {}, config):
            self.special_tokens.update(_named_tokens(named))
        self._hf = hf_tokenizer = HFTok.from_str(source)
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        self.bos_id = self._id_of(bos) if bos else model_config.get("bos_token_id")
        # A twin that reads special tokens as plain text, for encode_ordinary_batch.
        self._hf_plain = HFTok.from_str(self._hf.to_str())
        self._hf_plain.encode_special_tokens = True
        self.vocab_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        eos_ids = [self._id_of(eos)] if eos else []
        eos_ids += _eos_ids(model_config.get("eos_token_id"))
        eos_ids += _eos_ids((files.get("generation_config.json") or {}).get("eos_token_id"))
        self._stop_ids = tuple(dict.fromkeys(eos_ids))
        self.eot_id = self._stop_ids[0] if self._stop_ids else None
        model_type = json.loads(self._hf.to_str()).get("model", {}).get("type")
        self._clean_up = bool(config.get("clean_up_tokenization_spaces")) and (
            model_type != "BPE"
            or bool(
                config.get(
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
                )
            )
        )
        self._byte_level = byte_level_decoder(source)
        self._added = set(self._hf.get_added_tokens_decoder())
        self.decodes_in_pieces = self._byte_level and not self._clean_up

    def _id_of(self, token: str) -> int:
        i = self._hf.token_to_id(token)
        if i is None:
            raise GptkilnError(
                f"{HF_CONFIG_FILE}: the special token {token!r} is not in tokenizer.json's "
                "vocabulary; the two files are of different tokenizers, restore them"
            )
        return i

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def for_new_model(self) -> HFTokenizer:
        """This tokenizer as a model trained anew on it keeps it: its generation_config.json
        holds the token ids alone, not the sampling its own model was tuned for (a Qwen3
        tokenizer's temperature 0.6 is no setting of a model trained from scratch)."""
        generation = self.files.get("generation_config.json")
        if not isinstance(generation, dict):
            return self
        ids = {k: v for k, v in generation.items() if k.endswith("token_id")}
        if ids == generation:
            return self
        return HFTokenizer(self._source, {**self.files, "generation_config.json": ids})

    def with_stop_id(self, token_id: int) -> HFTokenizer:
        """This tokenizer with ``token_id`` among its `stop_ids` (after those it has), kept in
        its ``generation_config.json``'s ``eos_token_id`` as transformers reads it: a chat
        template's end of turn where the tokenizer's EOS is another (a base model's)."""
        if token_id in self._stop_ids:
            return self
        generation = dict(self.files.get("generation_config.json") or {})
        generation["eos_token_id"] = [*self._stop_ids, int(token_id)]
        return HFTokenizer(self._source, {**self.files, "generation_config.json": generation})

    @property
    def special_ids(self) -> frozenset[int]:
        added = self._hf.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=True).ids

    def encode_templated(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        encodings = self._hf_plain.encode_batch_fast(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        text = self._hf.decode([int(i) for i in ids], skip_special_tokens=False)
        if self._clean_up:  # transformers' clean_up_tokenization
            for spaced, joined in _CLEAN_UP:
                text = text.replace(spaced, joined)
        return text

    def _count_chars(self):
        """Byte-level (and byte-fallback) ids count the characters whose first UTF-8 byte they
        hold, as gpt2's and bpe's do; decoding each id alone counts a piece of a character as
        a whole U+FFFD."""
        from gptkiln.tokenizers.base import _lead_bytes_per_piece

        return _lead_bytes_per_piece([self.token_bytes(i) for i in range(self.vocab_size)])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for: a byte-level token's own bytes through the byte-level
        alphabet (a piece of a character is that piece, not the U+FFFD its decoding shows), a
        byte-fallback token ``<0xE6>`` its byte, an added token its text; any other its text."""
        piece = self._hf.id_to_token(int(token_id))
        if piece is None:
            raise GptkilnError(
                f"hf tokenizer: id {token_id} is outside its vocabulary of {self.vocab_size}; "
                "were these ids made by another tokenizer?"
            )
        if int(token_id) not in self._added:
            if self._byte_level:
                byte_of = _unicode_to_bytes()
                if all(ch in byte_of for ch in piece):
                    return bytes(byte_of[ch] for ch in piece)
            elif match := _BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(match[1], 16)])
        return self.decode([token_id]).encode("utf-8")

    def hf_json(self) -> str:
        """Its own tokenizer.json, as it came."""
        return self._source

    def _identity(self) -> str:
        config = self.files.get(HF_CONFIG_FILE) or {}
        kept = {k: v for k, v in config.items() if k != "chat_template"}
        return self._hf.to_str() + json.dumps([kept, self._stop_ids], sort_keys=True)

    def save(self, directory: str | os.PathLike) -> None:
        """As every tokenizer saves; the meta file also keeps the model config.json's BOS/EOS
        ids (a run's config.json is gptkiln's own, so they would be lost with the file)."""
        super().save(directory)
        meta_path = Path(directory) / META_FILE
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        model = self.files.get("config.json") or {}
        meta[MODEL_IDS_KEY] = {k: model[k] for k in ("bos_token_id", "eos_token_id") if k in model}
        meta_path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")

    def _save_files(self, directory: Path) -> None:
        (directory / BPE_FILE).write_text(self._source, encoding="utf-8")
        for name, content in self.files.items():
            if name == "config.json":
                continue  # the model's, not the tokenizer's: a run writes its own
            path = directory / name
            if name.endswith(".json"):
                path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", "utf-8")
            else:
                path.write_text(content, encoding="utf-8")

    @classmethod
    def load(cls, directory: Path) -> HFTokenizer:
        """The tokenizer of a Hugging Face directory, or of a run that keeps its files."""
        from tokenizers import Tokenizer as HFTok

        from gptkiln.chat_template import read_json

        path = directory / BPE_FILE
        if not path.is_file():
            raise GptkilnError(
                f"{directory}: a Hugging Face tokenizer with no {BPE_FILE}; gptkiln reads one "
                f"from its {BPE_FILE} (the 'fast' tokenizer): copy it from the model's repository"
            )
        try:
            source = path.read_text(encoding="utf-8")
            HFTok.from_str(source)
        except Exception as e:  # tokenizers raises plain Exception for bad files
            raise GptkilnError(
                f"{path}: not a readable tokenizers file ({e}); restore it from the model's "
                "repository"
            ) from None
        files: dict[str, Any] = {}
        for name in (HF_CONFIG_FILE, *HF_EXTRA_FILES, "config.json"):
            if (directory / name).is_file():
                is_json = name.endswith(".json")
                files[name] = (
                    read_json(directory / name)
                    if is_json
                    else (directory / name).read_text(encoding="utf-8")
                )
        meta_path = directory / META_FILE
        if meta_path.is_file():  # saved by gptkiln: config.json is the run's, the ids are here
            files["config.json"] = read_json(meta_path).get(MODEL_IDS_KEY) or {}
        return cls(source, files)


MODEL_IDS_KEY = "model_ids"
"""tokenizer_meta.json's entry for the model config.json's ``bos_token_id`` / ``eos_token_id``."""
_CORRUPT = "even_though_it_will_corrupt_output"  # transformers' flag's end
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def _named_tokens(source: dict[str, Any]) -> dict[str, str]:
    from gptkiln.chat_template import SPECIAL_TOKEN_NAMES, token_content

    return {
        name: content
        for name in SPECIAL_TOKEN_NAMES
        if (content := token_content(source.get(name))) is not None
    }


def is_hf_tokenizer_dir(directory: Path) -> bool:
    """A Hugging Face tokenizer's directory as the Hub has it: tokenizer_config.json or
    tokenizer.json without gptkiln's tokenizer_meta.json (a ``bpe`` tokenizer gptkiln trained
    saves a tokenizer.json too, always with the meta file, so the two never mix)."""
    has_files = (directory / HF_CONFIG_FILE).is_file() or (directory / BPE_FILE).is_file()
    return has_files and not (directory / META_FILE).is_file()
