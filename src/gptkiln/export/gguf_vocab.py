"""Tokenizers as GGUF holds them, both ways: llama.cpp's ``gpt2`` tokenizer model (a byte-level
BPE: ``tokenizer.ggml.tokens`` by id, their types, ``tokenizer.ggml.merges``, and the name of the
pre-tokenizer in ``tokenizer.ggml.pre``, which llama.cpp maps to its own splitting regexes).

Out (`gguf_vocab`): every kind gptkiln has. ``gpt2`` and ``bpe:N`` are byte-level BPEs with
GPT-2's pre-tokenizer (``"gpt-2"``); a model's own tokenizer (kind ``hf``) is named by its
splitting regex (Llama 3's ``"llama-bpe"``, Qwen2/3's ``"qwen2"``, GPT-2's), and refused when it
has another; a ``char`` vocabulary becomes a byte-level BPE whose tokens are its characters'
bytes, with merges that join the bytes of each multi-byte character and nothing across
characters, so llama.cpp's BPE gives one id per character.

In (`hf_tokenizer_json`): a GGUF's ``gpt2`` vocabulary as a Hugging Face tokenizer.json with the
same splitting (the regex of its ``pre`` name), the added tokens of its CONTROL and USER_DEFINED
types, and BOS added where ``tokenizer.ggml.add_bos_token`` says, which
`gptkiln.tokenizers.HFTokenizer` runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gptkiln.errors import GptkilnError
from gptkiln.tokenizers.base import EOT, _bytes_to_unicode

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # gguf.TokenType's values
_NEVER = _bytes_to_unicode()[0xC0]  # the stand-in of a byte no UTF-8 text holds

# The splitting regexes of the pre-tokenizers llama.cpp names (its llama-vocab.cpp has them as
# code; Hugging Face's tokenizer.json files have them as Split patterns).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2_PRE = "gpt-2"  # ByteLevel's own regex (GPT-2's)
PRE_PATTERNS = {"llama-bpe": LLAMA3_PATTERN, "qwen2": QWEN2_PATTERN}
IGNORE_MERGES = {"llama-bpe"}  # Llama 3 takes a word that is a token whole, as llama.cpp does


# The tokens llama.cpp ends a generation at by their text alone, besides the eos, eot and eom ids
# a file names (its llama-vocab.cpp keeps the list; these are those of the families gptkiln
# reads), and of them what fills its end-of-turn and end-of-message slots.
END_OF_GENERATION = ("<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>",
                     "<|im_end|>", "<|end|>", "<end_of_turn>", "<EOT>")  # fmt: skip
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<EOT>")
END_OF_MESSAGE = "<|eom_id|>"  # Llama 3.1's end of a tool call's message


@dataclass
class GGUFVocab:
    """What a GGUF's tokenizer keys hold (see the module docstring)."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    bos_id: int | None = None
    eos_id: int | None = None
    add_bos: bool = False
    stop_ids: list[int] = field(default_factory=list)
    pad_id: int | None = None  # the run's config.json pad_token_id (Qwen's), where it has one

    def turn_ends(self) -> tuple[int | None, int | None]:
        """The ids of llama.cpp's end-of-turn and end-of-message slots among the stop ids: the
        first whose text is an end of turn (``<|eot_id|>``, ``<|im_end|>``; else the first
        after the EOS that llama.cpp would not end at by its text, so that it still does), and
        ``<|eom_id|>``."""
        after = self.stop_ids[1:]
        eot = next((i for i in self.stop_ids if self.tokens[i] in END_OF_TURN), None)
        if eot is None:
            eot = next((i for i in after if self.tokens[i] not in END_OF_GENERATION), None)
        eom = next((i for i in self.stop_ids if self.tokens[i] == END_OF_MESSAGE), None)
        return eot, eom

    def ends_of_generation(self, named: list[int | None]) -> list[int]:
        """The ids a generation ends at as llama.cpp reads a file: those ``named`` (its eos,
        eot and eom ids), then every token whose text is one of `END_OF_GENERATION`."""
        texts = [i for i, token in enumerate(self.tokens) if token in END_OF_GENERATION]
        return [int(i) for i in dict.fromkeys([*named, *texts]) if i is not None]


def gguf_vocab(tokenizer: Any, vocab_size: int, source: str) -> GGUFVocab:
    """The GGUF vocabulary of a gptkiln tokenizer, padded with unused tokens to the model's
    ``vocab_size``; a tokenizer GGUF cannot express is refused in one line naming ``source``."""
    if tokenizer.kind == "char":
        vocab = _char_vocab(tokenizer, source)
    else:
        vocab = _bpe_vocab(json.loads(tokenizer.hf_json()), tokenizer, source)
    if len(vocab.tokens) > vocab_size:
        raise GptkilnError(
            f"{source}: the tokenizer has {len(vocab.tokens)} ids but the model only "
            f"{vocab_size} rows; GGUF needs a token for every row and a row for every token"
        )
    for i in range(len(vocab.tokens), vocab_size):  # the model's padding rows
        vocab.tokens.append(f"[PAD{i}]")
        vocab.types.append(UNUSED)
    stops = list(tokenizer.stop_ids)
    if not stops:  # llama.cpp takes a GPT-2 vocabulary's id 11 for its end of text then
        eleven = f" (id 11, {tokenizer.decode([11])!r})" if len(vocab.tokens) > 11 else ""
        raise GptkilnError(
            f"{source}: its tokenizer has no end-of-text token, so llama.cpp would take one of "
            f"its characters for it{eleven} and stop there; export it to Hugging Face instead "
            "(convert to-hf), or train on a corpus of documents (.jsonl or a folder), whose "
            "tokenizer has one"
        )
    vocab.stop_ids = stops
    vocab.eos_id = stops[0]
    if tokenizer.kind == "hf":
        vocab.bos_id = tokenizer.bos_id
        ids = tokenizer.encode("")  # what its post-processor adds to every text
        vocab.add_bos = bool(ids) and ids[0] == tokenizer.bos_id
    else:
        vocab.bos_id = vocab.eos_id
    return vocab


def _byte_level(text: str) -> str:
    """A string's UTF-8 bytes as GPT-2's printable stand-ins (what byte-level vocabularies hold)."""
    table = _bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def _char_vocab(tokenizer: Any, source: str) -> GGUFVocab:
    if "\n" not in tokenizer.chars:
        raise GptkilnError(
            f"{source}: its char vocabulary has no newline, which llama.cpp's tokenizer needs "
            "(it stops on a vocabulary without one); export it to Hugging Face instead "
            "(convert to-hf), or train on a corpus with more than one line"
        )
    tokens = [_byte_level(c) for c in tokenizer.chars]
    merges = []
    for c in tokenizer.chars:  # join each multi-byte character's bytes, left to right
        pieces = [_byte_level(c)[i] for i in range(len(c.encode("utf-8")))]
        for i in range(1, len(pieces)):
            merges.append(f"{''.join(pieces[:i])} {pieces[i]}")
    if not merges:  # llama.cpp refuses a file without merges: one that never applies (0xC0
        merges = [f"{_NEVER} {_NEVER}"]  # is in no UTF-8 text)
    types = [NORMAL] * len(tokens)
    if tokenizer.eot_id is not None:
        tokens.append(EOT)
        types.append(CONTROL)
    return GGUFVocab(tokens, types, list(dict.fromkeys(merges)), GPT2_PRE)


def _bpe_vocab(spec: dict[str, Any], tokenizer: Any, source: str) -> GGUFVocab:
    """A byte-level BPE's tokenizer.json (gpt2, bpe:N, a model's own) as a GGUF vocabulary."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not _has_byte_level(spec.get("decoder")):
        raise GptkilnError(
            f"{source}: its tokenizer is a {model.get('type')} model, not a byte-level BPE, which "
            "is the kind GGUF's gpt2 tokenizer holds; export it to Hugging Face instead "
            "(convert to-hf)"
        )
    pre = _pre_name(spec.get("pre_tokenizer"), source)
    added = {t["id"]: t for t in spec.get("added_tokens") or []}
    size = max([*model["vocab"].values(), *added, -1]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [UNUSED] * size
    for token, i in model["vocab"].items():
        tokens[i], types[i] = token, NORMAL
    for i, t in added.items():
        tokens[i], types[i] = t["content"], CONTROL if t.get("special") else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return GGUFVocab(tokens, types, merges, pre)


def _has_byte_level(part: dict[str, Any] | None) -> bool:
    if not part:
        return False
    if part.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(p) for p in part.get("decoders") or part.get("pretokenizers") or [])


def _pre_name(pre: dict[str, Any] | None, source: str) -> str:
    """llama.cpp's name for a tokenizer.json's pre-tokenizer: GPT-2's ByteLevel regex, or a
    Split by a regex llama.cpp knows, before a ByteLevel without one."""
    if pre and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return GPT2_PRE
    parts = (pre or {}).get("pretokenizers") or []
    splits = [p for p in parts if p.get("type") == "Split"]
    if len(splits) == 1 and _has_byte_level(pre):
        pattern = (splits[0].get("pattern") or {}).get("Regex")
        for name, known in PRE_PATTERNS.items():
            if pattern == known:
                return name
    raise GptkilnError(
        f"{source}: its tokenizer splits text with a pre-tokenizer llama.cpp has no name for "
        f"(GGUF names GPT-2's, Llama 3's and Qwen's: {', '.join([GPT2_PRE, *PRE_PATTERNS])}); "
        "export it to Hugging Face instead (convert to-hf)"
    )


# -- in ------------------------------------------------------------------------------------
def hf_tokenizer_json(vocab: GGUFVocab, source: str) -> str:
    """A Hugging Face tokenizer.json for a GGUF's ``gpt2`` vocabulary (see the module docstring)."""
    from tokenizers import (
        AddedToken,
        Regex,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from tokenizers import Tokenizer as HFTokenizer

    if vocab.pre != GPT2_PRE and vocab.pre not in PRE_PATTERNS:
        raise GptkilnError(
            f"{source}: tokenizer.ggml.pre is {vocab.pre!r}, a pre-tokenizer gptkiln does not "
            f"read (it reads {', '.join([GPT2_PRE, *PRE_PATTERNS])}); convert the model from its "
            "Hugging Face directory instead (gptkiln convert hf)"
        )
    # every token in the BPE's vocabulary, the added ones too (as tokenizer.json files have
    # them), so that each keeps its id when it is added
    plain = {t: i for i, t in enumerate(vocab.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    try:
        bpe = models.BPE(vocab=plain, merges=merges, ignore_merges=vocab.pre in IGNORE_MERGES)
        hf = HFTokenizer(bpe)
    except Exception as e:  # tokenizers raises plain Exception for inconsistent merges
        raise GptkilnError(f"{source}: its vocabulary and merges disagree ({e})") from None
    if vocab.pre == GPT2_PRE:
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        split = pre_tokenizers.Split(Regex(PRE_PATTERNS[vocab.pre]), behavior="isolated")
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        if vocab.pre == "qwen2":
            hf.normalizer = normalizers.NFC()
    hf.decoder = decoders.ByteLevel()
    added = [
        AddedToken(t, special=k == CONTROL, normalized=False)
        for t, k in zip(vocab.tokens, vocab.types)
        if k in (CONTROL, USER_DEFINED)
    ]
    hf.add_tokens(added)
    for token, i in ((t, i) for i, t in enumerate(vocab.tokens)):
        if vocab.types[i] in (CONTROL, USER_DEFINED) and hf.token_to_id(token) != i:
            raise GptkilnError(
                f"{source}: its special token {token!r} (id {i}) is not where a Hugging Face "
                "tokenizer can put it; convert the model from its Hugging Face directory instead"
            )
    if vocab.add_bos and vocab.bos_id is not None:
        bos = vocab.tokens[vocab.bos_id]
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, vocab.bos_id)],
        )
    return hf.to_str()
