"""GGUF files into runs: ``gptkiln convert gguf FILE.gguf --out RUN``.

A GGUF of llama.cpp's ``gpt2``, ``llama`` or ``qwen3`` architecture (as its own converter,
``convert_hf_to_gguf.py``, and quantizer write them, or as `gptkiln.export.gguf` does) becomes
the Hugging Face config and state dict of its family (the one name table of
`gptkiln.export.gguf`, read backwards; Llama's q/k rows back to rotate-half, GPT-2's Conv1D
layouts), which `gptkiln.loading`'s own readers turn into gptkiln's: a GGUF is read the way a
Hugging Face directory is, past its own format.

Tensor types: f32, f16, bf16 and q8_0, each dequantized to float32 (`gguf.quants`, ggml's own
layouts); a q8_0 file's run holds its q8_0 values exactly, as float32 (``gptkiln convert
quantize`` makes an int8 run of it, rounding once more to one scale per row). Llama 3's
``rope_freqs`` goes back to the RoPE scaling that gives it; another scaling (``rope.scaling.type``
yarn, linear) or a partial rotation is refused, as ``convert hf`` refuses it. The tokenizer
(GGUF's ``gpt2`` byte-level BPE, `gptkiln.export.gguf_vocab`) becomes the run's Hugging Face
tokenizer (kind ``hf``), with the chat template and the BOS / EOS ids (BOS added where the file
says, or for Llama 3's pre-tokenizer where it is silent, as llama.cpp does), and config.json the
bos / eos / pad ids; a char vocabulary (as gptkiln writes one) comes back as the ``char``
tokenizer it was.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptkiln.checkpoint import save_model
from gptkiln.config import GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.export.files import staged_run
from gptkiln.export.gguf import FAMILY_OF_ARCH, HF_TO_GGUF, ROPE_FREQS, rename, unpermute_rope
from gptkiln.export.gguf_vocab import (
    CONTROL,
    GPT2_PRE,
    NORMAL,
    UNUSED,
    GGUFVocab,
    hf_tokenizer_json,
)
from gptkiln.loading import build_model
from gptkiln.loading.hf_gpt2 import CONV1D
from gptkiln.run_guard import check_out_dir

READ_TYPES = ("F32", "F16", "BF16", "Q8_0")
LLAMA3_PRES = ("llama-bpe", "llama3", "llama-v3")  # llama.cpp adds BOS for these, unless told


def import_gguf(
    gguf_file: str | os.PathLike, out_run_dir: str | os.PathLike, *, overwrite: bool = False
) -> Path:
    """Write the model and tokenizer of a GGUF file as a run (see the module docstring).

    Raises:
        GptkilnError: a file that is truncated or not a GGUF, an architecture, tensor type or
            tokenizer not handled, in one line naming the file; nothing is written then.
    """
    path, out = Path(gguf_file), Path(out_run_dir)
    reader = open_gguf(path)
    meta = {f.name: f for f in reader.fields.values()}
    arch = _value(meta, "general.architecture", path)
    if arch not in FAMILY_OF_ARCH:
        raise GptkilnError(
            f"{path}: a GGUF of the {arch!r} architecture; gptkiln reads "
            f"{', '.join(FAMILY_OF_ARCH)} (GPT-2, Llama 3, Qwen3)"
        )
    stale = check_out_dir(out, overwrite=overwrite)  # before the tensors are dequantized
    hf_sd, rope_freqs = _hf_state_dict(reader, arch, path)
    hf_config = _hf_config(meta, arch, hf_sd, rope_freqs, path)
    vocab = _vocab(meta, path, hf_config["vocab_size"])
    tokenizer = _tokenizer(vocab, meta, hf_config, path)
    module = _family_module(arch)
    config = module.config_from_hf(hf_config, str(path))
    _check_tensors(hf_sd, config, arch, path)
    model = build_model(
        config, module.hf_state_dict_to_gptkiln(hf_sd, config, str(path)), str(path)
    )
    with staged_run(out, stale) as stage:
        save_model(model, stage, tokenizer=tokenizer, extra=_token_ids(vocab))
    return out


def _check_tensors(
    hf_sd: dict[str, torch.Tensor], config: GPTConfig, arch: str, path: Path
) -> None:
    """One line naming, as the file names them (``blk.1.ffn_down.weight``), the tensors the
    model its metadata describes has and the file lacks, or holds at another shape (as the file
    holds them: GPT-2's Conv1D weights (out, in))."""
    from gptkiln.interop import gptkiln_state_dict_to_hf
    from gptkiln.loading.checks import expected_shapes

    meta = {n: torch.empty(s, device="meta") for n, s in expected_shapes(config).items()}
    wanted = gptkiln_state_dict_to_hf(meta, config)
    table = HF_TO_GGUF[arch]

    def in_file(name: str, shape: torch.Size) -> tuple[int, ...]:
        conv1d = arch == "gpt2" and CONV1D.match(name.removeprefix("transformer."))
        return tuple(shape[::-1] if conv1d else shape)

    missing = [rename(n, table) for n in wanted if n not in hf_sd]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise GptkilnError(
            f"{path}: the file lacks tensor {', '.join(missing[:3])}{more}, which its metadata's "
            f"{arch} model has; it is cut short or of another variant, convert it again"
        )
    wrong = [
        f"{rename(n, table)} is {in_file(n, hf_sd[n].shape)}, not {in_file(n, t.shape)}"
        for n, t in wanted.items()
        if hf_sd[n].shape != t.shape
    ]
    if wrong:
        raise GptkilnError(
            f"{path}: tensor {'; '.join(wrong[:3])} as its metadata's {arch} model has it; the "
            "file's tensors and metadata disagree, convert it again"
        )


def _token_ids(vocab: GGUFVocab) -> dict[str, Any]:
    """The run's config.json ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` (those a
    Hugging Face model's config.json has, and `convert to-hf` writes back) of the file's."""
    stops = vocab.stop_ids
    ids = {
        "bos_token_id": vocab.bos_id,
        "eos_token_id": (stops[0] if len(stops) == 1 else stops) if stops else None,
        "pad_token_id": vocab.pad_id,
    }
    return {k: v for k, v in ids.items() if v is not None}


def open_gguf(path: Path) -> Any:
    """A `gguf.GGUFReader` of ``path``, or one line saying why it cannot be read."""
    import gguf

    if path.is_dir():
        raise GptkilnError(f"{path} is a directory; give the path of a .gguf file in it")
    if not path.is_file():
        raise GptkilnError(f"{path}: no such file; give the path of a .gguf file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":  # what every GGUF file begins with
        raise GptkilnError(
            f"{path}: not a GGUF file (it begins with {magic!r}, not b'GGUF'); give a .gguf "
            "file, such as llama.cpp's converter or gptkiln convert to-gguf writes"
        )
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError, IndexError, ... on a cut or foreign file
        raise GptkilnError(
            f"{path}: not a readable GGUF file, truncated or of another format ({e}); "
            "download or convert it again"
        ) from None


def _value(meta: dict[str, Any], key: str, path: Path, default: Any = ...) -> Any:
    field = meta.get(key)
    if field is None:
        if default is ...:
            raise GptkilnError(f"{path}: the GGUF has no {key}; it is incomplete, convert it again")
        return default
    return field.contents()


def _family_module(arch: str) -> Any:
    from gptkiln.loading import hf_gpt2, hf_llama

    return hf_gpt2 if arch == "gpt2" else hf_llama


def _hf_state_dict(
    reader: Any, arch: str, path: Path
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The file's tensors, dequantized to float32, under Hugging Face's names and layouts; and
    Llama 3's rope_freqs (None without)."""
    import gguf

    back = {gguf_name: hf for hf, gguf_name in HF_TO_GGUF[arch].items()}
    heads = {}
    for f in reader.fields.values():
        if f.name in (f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"):
            heads[f.name.rsplit(".", 1)[-1]] = f.contents()
    out, rope_freqs = {}, None
    for t in reader.tensors:
        if t.tensor_type.name not in READ_TYPES:
            raise GptkilnError(
                f"{path}: tensor {t.name} is of type {t.tensor_type.name}; gptkiln reads "
                f"{', '.join(READ_TYPES)} (requantize with llama.cpp's llama-quantize, or convert "
                "with --outtype f16 / q8_0)"
            )
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        tensor = torch.from_numpy(np.array(array, dtype=np.float32).reshape(t.shape[::-1].tolist()))
        if t.name == ROPE_FREQS:
            rope_freqs = tensor
            continue
        name = rename(t.name, back)
        if name is None:
            raise GptkilnError(
                f"{path}: tensor {t.name} is not one of a {arch} model gptkiln reads; the file "
                "is of a variant gptkiln does not handle"
            )
        if arch == "gpt2" and CONV1D.match(name.removeprefix("transformer.")):
            tensor = tensor.t()
        elif arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            key = "head_count" if ".q_proj." in name else "head_count_kv"
            tensor = unpermute_rope(tensor, _rope_heads(heads, key, tensor, t.name, path))
        out[name] = tensor.contiguous()
    return out, rope_freqs


def _rope_heads(
    heads: dict[str, Any], key: str, tensor: torch.Tensor, name: str, path: Path
) -> int:
    """The heads a llama q or k tensor's rows split into (``head_count_kv`` falls back to
    ``head_count``), checked against its rows before they are unpermuted."""
    count = heads.get(key, heads.get("head_count"))
    field = f"llama.attention.{key if key in heads else 'head_count'}"
    if count is None:
        raise GptkilnError(f"{path}: the GGUF has no {field}; it is incomplete, convert it again")
    rows = tensor.shape[0]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1 or rows % (2 * count):
        raise GptkilnError(
            f"{path}: {field} is {count!r}, which does not split tensor {name}'s {rows} rows "
            "into heads; the file's metadata is inconsistent, convert it again"
        )
    return count


def _hf_config(
    meta: dict[str, Any],
    arch: str,
    sd: dict[str, torch.Tensor],
    rope_freqs: torch.Tensor | None,
    path: Path,
) -> dict[str, Any]:
    """The Hugging Face config.json of the file's model (what `gptkiln.loading` reads)."""

    def get(key: str, default: Any = ...) -> Any:
        return _value(meta, f"{arch}.{key}", path, default)

    def count(key: str, default: Any = ...) -> int:  # a size: a whole number >= 1
        value = get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GptkilnError(
                f"{path}: {arch}.{key} is {value!r}, not a whole number >= 1; the file's "
                "metadata is damaged, convert it again"
            )
        return value

    embed = "transformer.wte.weight" if arch == "gpt2" else "model.embed_tokens.weight"
    if embed not in sd:
        raise GptkilnError(f"{path}: no token_embd.weight; the file is incomplete")
    vocab_size, n_embd = sd[embed].shape
    tied = "lm_head.weight" not in sd
    if arch == "gpt2":
        return {
            "model_type": "gpt2",
            "vocab_size": vocab_size,
            "n_positions": count("context_length"),
            "n_embd": n_embd,
            "n_layer": count("block_count"),
            "n_head": count("attention.head_count"),
            "layer_norm_epsilon": _f32(get("attention.layer_norm_epsilon", 1e-5)),
            "activation_function": "gelu_new",
            "tie_word_embeddings": tied,
        }
    n_head = count("attention.head_count")
    head_dim = count("attention.key_length", n_embd // n_head or 1)
    theta = float(get("rope.freq_base", 10000.0))
    _check_plain_rope(get, arch, head_dim, path)
    attn_bias = any(k.endswith("proj.bias") and "self_attn" in k for k in sd)
    mlp_bias = any(k.endswith("proj.bias") and ".mlp." in k for k in sd)
    if attn_bias or mlp_bias:
        _zero_missing_biases(sd, attn_bias, mlp_bias)
    return {
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": n_embd,
        "intermediate_size": count("feed_forward_length"),
        "num_hidden_layers": count("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": count("attention.head_count_kv", n_head),
        "head_dim": head_dim,
        "max_position_embeddings": count("context_length"),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(rope_freqs, theta, head_dim, path),
        "attention_bias": attn_bias or mlp_bias,
        "mlp_bias": mlp_bias,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
    }


def _check_plain_rope(get: Callable[..., Any], arch: str, head_dim: int, path: Path) -> None:
    """RoPE as gptkiln computes it: every dimension of a head rotated, and no scaling but Llama
    3's (the ``rope_freqs`` tensor); a YaRN or linear ``rope.scaling.type`` is refused, as
    ``convert hf`` refuses one, not read as plain RoPE (llama.cpp would compute it)."""
    scaling = get("rope.scaling.type", None)
    if scaling not in (None, "none"):
        raise GptkilnError(
            f"{path}: {arch}.rope.scaling.type is {scaling!r}, a RoPE scaling gptkiln does not "
            "compute (it computes plain RoPE and Llama 3's frequency scaling); this model "
            "cannot be converted"
        )
    factor = get("rope.scaling.factor", None)
    factor = get("rope.scale_linear", None) if factor is None else factor  # (its older key)
    if factor not in (None, 0, 1):  # llama.cpp divides the positions by it, whatever the type
        raise GptkilnError(
            f"{path}: {arch}.rope.scaling.factor is {factor!r}, a RoPE scaling gptkiln does "
            "not compute (it computes plain RoPE and Llama 3's frequency scaling); this model "
            "cannot be converted"
        )
    rotated = get("rope.dimension_count", head_dim)
    if rotated != head_dim:
        raise GptkilnError(
            f"{path}: {arch}.rope.dimension_count is {rotated!r} of a head's {head_dim} "
            "dimensions; gptkiln rotates every dimension of a head, so this model cannot be "
            "converted"
        )


def _f32(value: float) -> float:
    """A float32 value of the file as the decimal it was written from (1e-5, not 9.9999997e-6)."""
    return float(f"{float(value):.7g}")


def _zero_missing_biases(sd: dict[str, torch.Tensor], attn: bool, mlp: bool) -> None:
    """Hugging Face's Llama has biases on all of q/k/v/o (and the MLP) or none: zeros where a
    GGUF holds some (Qwen2-style q/k/v biases without o's), which compute the same."""
    parts = [*(["q", "k", "v", "o"] if attn else []), *(["gate", "up", "down"] if mlp else [])]
    for name in [n for n in sd if n.endswith("_proj.weight")]:
        part = name.rsplit(".", 2)[-2].removesuffix("_proj")
        if part in parts:
            sd.setdefault(name.removesuffix(".weight") + ".bias", torch.zeros(sd[name].shape[0]))


def _rope_scaling(
    factors: torch.Tensor | None, theta: float, head_dim: int, path: Path
) -> dict[str, Any] | None:
    """Llama 3's RoPE scaling from the per-frequency factors llama.cpp stores (`rope_freqs`):
    ``factor`` is the largest; the blend between is linear in 1 / wavelength, which gives its
    bounds (any bounds in the gaps give the same frequencies when there is no blend)."""
    if factors is None or torch.allclose(factors, torch.ones_like(factors)):
        return None
    factor = float(factors.max())
    i = torch.arange(0, head_dim, 2, dtype=torch.float64)
    wavelen = 2 * math.pi * theta ** (i / head_dim)  # (hs/2,)
    f = factors.double()
    kept_at, divided_at = f <= 1 + 1e-5, f >= factor * (1 - 1e-5)  # float32's own rounding
    blend = ~kept_at & ~divided_at
    s = (1 / f - 1 / factor) / (1 - 1 / factor)  # = (original / wavelen - low) / (high - low)
    if int(blend.sum()) >= 2:  # s = A / wavelen - B, a line through any two
        # A = original / (high - low) and B = low / (high - low) fix the frequencies; of the
        # bounds that give them, those whose original is a whole number (low = original B / A)
        x = 1 / wavelen[blend]
        a = float((s[blend][-1] - s[blend][0]) / (x[-1] - x[0]))
        b = float(a * x[0] - s[blend][0])
        original = float(max(1, round(a / b)))
        low = original * b / a
        high = low * (1.0 + 1.0 / b)
        rounded = {"factor": factor, "low_freq_factor": round(low, 4)}
        rounded |= {"high_freq_factor": round(high, 4), "original_context_length": original}
        if _gives(rounded, f, theta, head_dim):  # Llama 3.1's 1.0 and 4.0, not 0.99999994
            low, high = rounded["low_freq_factor"], rounded["high_freq_factor"]
    elif int(blend.sum()) == 1:  # one point (wavelength w0, blend s0): room for the bounds
        w0, s0 = float(wavelen[blend][0]), float(s[blend][0])
        kept, divided = wavelen[kept_at], wavelen[divided_at]
        # with high = low + (original / w0 - low) / s0, the divided stay past original / low
        # and the kept below original / high where low / original is in [lowest, 1 / w0)
        lowest = 1 / float(divided.min()) if len(divided) else 0.0
        if len(kept):
            top = float(kept.max())
            lowest = max(lowest, (1 / w0 - s0 / top) / (1 - s0))
        ratio = math.sqrt(lowest / w0) if lowest > 0 else 0.5 / w0  # inside, away from the ends
        original = float(max(1, round(1 / ratio)))
        low = 1.0 if lowest <= 1 / original < 1 / w0 else original * ratio  # 1.0 where it fits
        high = low + (original / w0 - low) / s0
    else:  # no blend: the bounds anywhere in the gap between kept and divided frequencies
        kept, divided = wavelen[kept_at], wavelen[divided_at]
        low_wavelen = float(divided.min()) * 0.999  # original: below every divided one
        high_wavelen = float(kept.max()) * 1.001 if len(kept) else low_wavelen / 2
        original = float(math.floor(low_wavelen))  # a whole number where one fits the gap
        if original <= high_wavelen:
            original = low_wavelen
        low, high = 1.0, original / high_wavelen  # original / high: above every kept one
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
    ours = {"factor": factor, "low_freq_factor": low, "high_freq_factor": high}
    ours["original_context_length"] = original
    if not _gives(ours, f, theta, head_dim):
        raise GptkilnError(
            f"{path}: its rope_freqs are not Llama 3's frequency scaling, the one gptkiln "
            "computes; the file is of a RoPE variant gptkiln does not handle"
        )
    return scaling


def _gives(scaling: dict[str, float], factors: torch.Tensor, theta: float, head_dim: int) -> bool:
    """Whether gptkiln's Llama 3 scaling of ``scaling`` gives ``factors`` (float32's rounding)."""
    from gptkiln.export.gguf import rope_factors

    try:
        config = GPTConfig.from_name(
            "llama3-baby", head_dim=head_dim, rope_theta=theta, rope_scaling=scaling
        )
    except GptkilnError:  # bounds out of order, a context that is no whole number
        return False
    return torch.allclose(rope_factors(config).double(), factors, rtol=1e-4, atol=1e-5)


def _token_id(meta: dict[str, Any], key: str, rows: int, path: Path) -> int | None:
    value = _value(meta, key, path, None)
    if value is not None and (isinstance(value, bool) or not 0 <= value < rows):
        raise GptkilnError(
            f"{path}: {key} is {value!r}, not an id of its {rows:,} tokens; the file's metadata is "
            "damaged, convert it again"
        )
    return value


def _vocab(meta: dict[str, Any], path: Path, rows: int) -> GGUFVocab:
    model = _value(meta, "tokenizer.ggml.model", path)
    if model != "gpt2":
        raise GptkilnError(
            f"{path}: its tokenizer is llama.cpp's {model!r} model; gptkiln reads the byte-level "
            "BPE ('gpt2') that GPT-2, Llama 3 and Qwen3 use"
        )
    tokens = list(_value(meta, "tokenizer.ggml.tokens", path))
    types = [int(t) for t in _value(meta, "tokenizer.ggml.token_type", path)]
    if len(tokens) != rows or len(types) != rows:
        raise GptkilnError(
            f"{path}: its vocabulary has {len(tokens):,} tokens and {len(types):,} token types "
            f"for the {rows:,} rows of token_embd.weight; a GGUF has one of each a row: the file "
            "is damaged, convert it again"
        )
    bos, eos, eot, eom = (
        _token_id(meta, f"tokenizer.ggml.{name}_token_id", rows, path)
        for name in ("bos", "eos", "eot", "eom")
    )
    pad = _value(meta, "tokenizer.ggml.padding_token_id", path, None)
    if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < rows:
        pad = None  # no id of the file's (some converters write one past the vocabulary)
    pre = _value(meta, "tokenizer.ggml.pre", path, "default")
    vocab = GGUFVocab(
        tokens=tokens,
        types=types,
        merges=list(_value(meta, "tokenizer.ggml.merges", path)),
        pre=pre,
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
        # unsaid: llama.cpp's default, BOS for Llama 3's pre-tokenizer (older files say nothing)
        add_bos=bool(_value(meta, "tokenizer.ggml.add_bos_token", path, pre in LLAMA3_PRES)),
        pad_id=None if pad is None else int(pad),
    )
    vocab.stop_ids = vocab.ends_of_generation([eos, eot, eom])  # llama.cpp's stops
    return vocab


def _char_tokenizer(vocab: GGUFVocab) -> Any:
    """The `gptkiln.tokenizers.CharTokenizer` of a vocabulary that is one (each token one
    character's bytes, in code-point order, ``<|endoftext|>`` last: what `gguf_vocab` writes for
    a char run), else None."""
    from gptkiln.tokenizers import EOT, CharTokenizer
    from gptkiln.tokenizers.base import _unicode_to_bytes

    byte_of = _unicode_to_bytes()
    used = [(t, k) for t, k in zip(vocab.tokens, vocab.types) if k != UNUSED]
    with_eot = bool(used) and used[-1] == (EOT, CONTROL)
    chars = []
    for token, kind in used[: len(used) - with_eot]:
        try:
            char = bytes(byte_of[c] for c in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            return None
        if kind != NORMAL or len(char) != 1:
            return None
        chars.append(char)
    if not chars or chars != sorted(set(chars)) or vocab.pre != GPT2_PRE:
        return None
    return CharTokenizer(chars, with_eot=with_eot)


def _tokenizer(vocab: GGUFVocab, meta: dict[str, Any], hf_config: dict, path: Path) -> Any:
    """The run's tokenizer: a char vocabulary's `CharTokenizer`, else a Hugging Face one
    (`gptkiln.tokenizers.HFTokenizer`) of the vocabulary."""
    from gptkiln.tokenizers import HFTokenizer

    char = _char_tokenizer(vocab)
    if char is not None:
        return char
    source = hf_tokenizer_json(vocab, str(path))
    named = {}
    if vocab.bos_id is not None:
        named["bos_token"] = vocab.tokens[vocab.bos_id]
    if vocab.eos_id is not None:
        named["eos_token"] = vocab.tokens[vocab.eos_id]
    chat = _value(meta, "tokenizer.chat_template", path, None)
    if chat is not None:  # a broken template refused now, not at the first chat
        from gptkiln.chat_template import compile_template

        compile_template(chat, f"{path} tokenizer.chat_template")
    tokenizer_config = {
        **named,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": hf_config.get("max_position_embeddings") or hf_config["n_positions"],
        **({"chat_template": chat} if chat else {}),
    }
    ids = {"bos_token_id": vocab.bos_id, "eos_token_id": vocab.stop_ids or None}
    files = {
        "tokenizer_config.json": tokenizer_config,
        "generation_config.json": {k: v for k, v in ids.items() if v is not None},
        "config.json": {k: v for k, v in ids.items() if v is not None},
    }
    return HFTokenizer(source, files)
