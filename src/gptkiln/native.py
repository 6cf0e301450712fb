"""The project's own compiled kernels: C sources in ``gptkiln/csrc``, built once per machine.

`few_rows_library` compiles ``csrc/few_rows.c`` (`gptkiln.kernels.few_rows_linear`: fp32
products of a few rows with AVX-512; `int8_rows_library` types its int8-weight twin,
`gptkiln.kernels.int8_rows_linear`, and `bf16_rows_library` the one for bf16 copies of fp32
weights, `gptkiln.kernels.bf16_rows_linear`), `q8_rows_library` ``csrc/q8_rows.c``
(`gptkiln.kernels.q8_rows_linear`: int8 weights times 8-bit activations, by VNNI),
`target_log_probs_library`
``csrc/target_log_probs.c`` (`target_log_probs`: the log-probability of one token a row, for
scoring), `gelu_library` ``csrc/gelu.c`` (`gelu_tanh_`: GPT-2's MLP activation with its bias,
in place) and `decode_attention_library` ``csrc/decode_attention.c`` (`decode_attention`: one
new token a row over the KV cache), with the system's C compiler the first time a process asks
for it, into the cache directory
(`gptkiln.cache.cache_dir`, ``native/``), and loads it with ``ctypes``; later processes load the
built file. The sources include no Python or torch headers, so building takes well under a
second and needs only a C compiler with OpenMP (gcc, clang), as inductor's own CPU kernels do.

A library is named by a digest of its source, the other sources beside it (a file may include
them: ``vexp.h``; ``decode_blocks.c`` includes the product, attention and GELU loops), the
compiler (its resolved path, size and time) and the flags, so an edited source or header or a
new compiler builds a new one (and the old is removed).
Two processes may build at once: each writes its own temporary file and renames it into place
(``os.replace``, atomic). A file that does not load (truncated, another machine's) is built
again.

Where there is no compiler, the build fails, the CPU lacks AVX-512
(``torch.backends.cpu.get_cpu_capability``), the platform is not Linux on x86-64, or
``GPTKILN_NATIVE=0`` is set, the function returns None and the kernels that need it are not
offered: everything runs on torch's own, as before. ``CC`` picks the compiler (default: ``cc``,
then ``gcc``, then ``clang``). Its OpenMP loops run on torch's OpenMP runtime where the soname
matches (gcc's ``libgomp.so.1``, which torch's Linux wheels load first), so the two share one
pool of threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCES = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp")
ENV = "GPTKILN_NATIVE"
"""``GPTKILN_NATIVE=0`` turns the compiled kernels off (torch's own are used)."""


@functools.cache
def few_rows_library() -> ctypes.CDLL | None:
    """``csrc/few_rows.c`` built and loaded (its ``few_rows_linear`` typed), or None where it
    cannot be (see the module's docstring). Built at most once per process."""
    return _typed("few_rows", "few_rows_linear", [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4)


@functools.cache
def target_log_probs_library() -> ctypes.CDLL | None:
    """``csrc/target_log_probs.c`` built and loaded (its ``target_log_probs`` typed), or None
    where it cannot be, as `few_rows_library`."""
    return _typed(
        "target_log_probs",
        "target_log_probs",
        [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int],
    )


@functools.cache
def int8_rows_library() -> ctypes.CDLL | None:
    """``csrc/few_rows.c`` built and loaded with its ``int8_rows_linear`` typed (the same loop
    for int8 weights), or None where it cannot be, as `few_rows_library`."""
    return _typed("few_rows", "int8_rows_linear", [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4)


@functools.cache
def bf16_rows_library() -> ctypes.CDLL | None:
    """``csrc/few_rows.c`` built and loaded with its ``bf16_rows_linear`` typed (the same loop
    for a bf16 copy of fp32 weights), or None where it cannot be, as `few_rows_library`."""
    return _typed("few_rows", "bf16_rows_linear", [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4)


@functools.cache
def q8_rows_library() -> ctypes.CDLL | None:
    """``csrc/q8_rows.c`` built and loaded (its ``q8_rows_linear`` typed: int8 weights times
    activations rounded to 8 bits, by AVX-512 VNNI), or None where it cannot be, as
    `few_rows_library`, or where the CPU lacks VNNI (the library's ``q8_supported``)."""
    lib = _typed("q8_rows", "q8_rows_linear", [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4)
    return lib if lib is not None and lib.q8_supported() else None


@functools.cache
def decode_attention_library() -> ctypes.CDLL | None:
    """``csrc/decode_attention.c`` built and loaded (its ``decode_attention`` typed), or None
    where it cannot be, as `few_rows_library`."""
    argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 11 + [ctypes.c_float, ctypes.c_int]
    return _typed("decode_attention", "decode_attention", argtypes)


@functools.cache
def decode_blocks_library() -> ctypes.CDLL | None:
    """``csrc/decode_blocks.c`` built and loaded (its ``gpt2_decode_blocks`` typed), or None
    where it cannot be, as `few_rows_library`."""
    argtypes = (
        [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        + [ctypes.c_int] * 5
        + [ctypes.c_int64] * 2
        + [ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    )
    return _typed("decode_blocks", "gpt2_decode_blocks", argtypes)


@functools.cache
def gelu_library() -> ctypes.CDLL | None:
    """``csrc/gelu.c`` built and loaded (its ``gelu_tanh`` typed), or None where it cannot be,
    as `few_rows_library`."""
    argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    return _typed("gelu", "gelu_tanh", argtypes)


def _typed(name: str, function: str, argtypes: list) -> ctypes.CDLL | None:
    """``csrc/NAME.c`` loaded (`load_built`), its ``function`` given ``argtypes`` and an int
    result; None where it is off, the CPU or platform does not fit, or it cannot be built."""
    if os.environ.get(ENV) == "0" or not _avx512_on_linux():
        return None
    lib = load_built(name)
    if lib is None:
        return None
    fn = getattr(lib, function)
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return lib


def target_log_probs(logits, targets, with_argmax: bool):
    """``(log_softmax(logits)[n, targets[n]] for every row n, each row's argmax or None)`` by
    ``csrc/target_log_probs.c``: logits (N, V) fp32 on the CPU, rows of unit stride; targets (N,)
    int64. The argmax (only ``with_argmax``) is a row's first index where several tie, as
    ``torch.argmax``'s. Each row is read once from memory and no (N, V) log-softmax is written.

    None where the library is not (`target_log_probs_library`) or the logits are not of that
    kind: the caller takes torch's ``log_softmax`` and ``gather`` (the reference,
    `gptkiln.evaluate.scoring._score_positions`)."""
    import torch

    lib = target_log_probs_library()
    if (
        lib is None
        or logits.dtype != torch.float32
        or logits.device.type != "cpu"
        or logits.dim() != 2
        or logits.stride(1) != 1
        or logits.size(0) == 0
    ):
        return None
    targets = targets.to(torch.int64).contiguous()
    out = torch.empty(logits.size(0), dtype=torch.float32)
    top = torch.empty(logits.size(0), dtype=torch.int64) if with_argmax else None
    refused = lib.target_log_probs(
        logits.data_ptr(),
        targets.data_ptr(),
        out.data_ptr(),
        None if top is None else top.data_ptr(),
        logits.size(0),
        logits.size(1),
        logits.stride(0),
        torch.get_num_threads(),
    )
    if refused:
        raise IndexError(f"a target is outside the {logits.size(1)} logits of its row")
    return out, top


def gelu_tanh_(y, bias) -> bool:
    """``y = gelu(y + bias)`` in place, GPT-2's tanh GELU, by ``csrc/gelu.c``: y (..., N) fp32
    on the CPU, contiguous; bias (N,) fp32 or None. False, and y untouched, where the library is
    not (`gelu_library`) or the tensors are not of that kind: the caller takes ``F.gelu``."""
    import torch

    lib = gelu_library()
    if (
        lib is None
        or y.dtype != torch.float32
        or y.device.type != "cpu"
        or not y.is_contiguous()
        or y.dim() == 0
        or y.numel() == 0
        or (
            bias is not None
            and (
                bias.dtype != torch.float32
                or bias.device.type != "cpu"
                or not bias.is_contiguous()
                or bias.shape != (y.size(-1),)
            )
        )
    ):
        return False
    cols = y.size(-1)
    bias_at = None if bias is None else bias.data_ptr()
    lib.gelu_tanh(y.data_ptr(), bias_at, y.numel() // cols, cols, cols, torch.get_num_threads())
    return True


def decode_attention(q, k, v, mask):
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)`` for one
    query a row (a decode step) by ``csrc/decode_attention.c``: q (B, H, 1, D), k and v
    (B, G, S, D) with H a multiple of G (each key/value head serving H / G consecutive query
    heads), every tensor fp32 on the CPU with unit stride over D (views of the projections and
    of the KV cache are taken as they are), D a multiple of 16 up to 256; ``mask`` None or a
    bool tensor that broadcasts to (B, 1, 1, S), True where a key may be attended. Returns
    (B, H, 1, D), or None where the library is not (`decode_attention_library`) or the tensors
    are not of that kind: the caller takes SDPA."""
    import torch

    lib = decode_attention_library()
    if lib is None or q.dim() != 4 or k.dim() != 4 or q.size(2) != 1:
        return None
    B, H, _, D = q.shape
    G, S = k.size(1), k.size(2)
    if (
        q.dtype != torch.float32
        or k.dtype != torch.float32
        or v.dtype != torch.float32
        or q.device.type != "cpu"
        or k.device.type != "cpu"
        or v.device.type != "cpu"
        or k.shape != (B, G, S, D)
        or v.shape != k.shape
        or k.stride() != v.stride()
        or q.stride(3) != 1
        or k.stride(3) != 1
        or D % 16
        or D > 256
        or H % G
        or S == 0
    ):
        return None
    if mask is not None:
        if mask.dtype != torch.bool or mask.device.type != "cpu":
            return None
        try:
            mask = mask.expand(B, 1, 1, S).reshape(B, S).contiguous()
        except RuntimeError:  # not a (B, 1, 1, S) mask: a query's own row of several
            return None
    out = torch.empty(B, H, 1, D, dtype=torch.float32)
    refused = lib.decode_attention(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        None if mask is None else mask.data_ptr(),
        out.data_ptr(),
        B,
        H,
        G,
        S,
        D,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        S,
        1.0 / D**0.5,
        torch.get_num_threads(),
    )
    return None if refused else out


class DecodeBlocks:
    """A GPT-2 model's blocks and final norm for one decode step, in one call of
    ``csrc/decode_blocks.c`` (`decode_blocks_library`): `gptkiln.model.GPT.hidden` hands it the
    embedded tokens and takes ``ln_f``'s output, which the head turns into logits as before.

    Given to a model (its ``decode_blocks``) by `gptkiln.kernels.use_native_blocks` for the row
    counts ``rows`` whose block products the tuner timed fastest as this project's own loops
    (``few_rows``, ``int8_rows``, ``q8_rows``): the step is those loops, the decode attention
    and the GELU in the order the model runs them, without the interpreter between them; each
    product by the loop its layer has at that moment (``loops``). It declines (None: the model
    runs its torch path) anything else: another family or layer kind, a layer whose kernel is
    not one of ``loops``, autograd, dropout that applies, tensors that are not fp32 on the CPU,
    a cache that does not fit.

    The addresses it passes (`_BlocksTable`) are gathered once and kept while the model stays
    as it was: every call checks that each layer, parameter, buffer and cache is still the
    object it was and still at the address it was (a replaced layer, ``param.data = ...``, a
    model moved or cast, a new cache: gathered again): ~60 us a step against ~1.7 ms to gather."""

    def __init__(self, loops: dict, rows=()):
        self.loops = loops
        """kernel -> the number ``csrc/decode_blocks.c`` runs it by (its ``KIND_*``): the
        products it takes are the layers whose kernel for the step's rows is one of these."""
        self.rows = set(rows)
        self._table: _BlocksTable | None = None

    def __call__(self, model, x, start_pos: int, mask):
        """ln_f(blocks(x)) for x (B, 1, C), the embedded new tokens at position ``start_pos``;
        ``mask`` None or the (B, 1, 1, S) bool mask of the keys each row may see. None where
        it does not take these."""
        import torch

        B = x.size(0)
        lib = decode_blocks_library() if B in self.rows else None
        c = model.config
        if (
            lib is None
            or c.family != "gpt2"
            or (model.training and c.dropout > 0)
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or x.shape != (B, 1, c.n_embd)
        ):
            return None
        table = self._table
        if table is None or not table.still(model):
            table = self._table = _BlocksTable.of(model)
            if table is None:
                return None
        if B > table.cache_rows or start_pos >= table.cache_len:
            return None
        try:  # each product by the loop its layer has now (none of them: the layers run)
            kinds = bytes([self.loops[layer.few_row_kernels.get(B)] for layer in table.products])
        except (KeyError, TypeError):
            return None
        if mask is not None:
            S = start_pos + 1
            try:
                mask = mask.expand(B, 1, 1, S).reshape(B, S).contiguous()
            except RuntimeError:
                return None
            if mask.dtype != torch.bool or mask.device.type != "cpu":
                return None
        ln_f = model.ln_f
        # written in place: a copy, so that a step refused half-way leaves the caller's x as it was
        x = x.reshape(B, c.n_embd).clone(memory_format=torch.contiguous_format)
        out = torch.empty(B, 1, c.n_embd, dtype=torch.float32)
        refused = lib.gpt2_decode_blocks(
            table.addresses.buffer_info()[0],
            kinds,
            len(model.h),
            x.data_ptr(),
            out.data_ptr(),
            B,
            c.n_embd,
            c.n_head,
            c.head_size,
            c.mlp_size,
            table.cache_len,
            start_pos,
            None if mask is None else mask.data_ptr(),
            ln_f.eps,
            ln_f.weight.data_ptr(),
            None if ln_f.bias is None else ln_f.bias.data_ptr(),
            torch.get_num_threads(),
        )
        return None if refused else out


class _BlocksTable:
    """The addresses `DecodeBlocks` passes, 18 a block (``csrc/decode_blocks.c``'s order), and
    what `still` checks them by: the dict, key and object of every layer, parameter, buffer
    and cache they came from (``module._modules``, ``_parameters``, ``_buffers``), and the tensors
    with the addresses they had."""

    def __init__(self):
        import array

        self.addresses = array.array("q")
        self.slots: tuple[list[dict], list[str], list] = ([], [], [])  # dict, key, object
        self.tensors: list = []
        self.pointers: list[int] = []
        self.products: list = []  # the block products, in the order of the table
        self.cache_rows = self.cache_len = 0

    def still(self, model) -> bool:
        """Whether the model is as it was when these addresses were gathered."""
        import operator

        import torch

        dicts, keys, objects = self.slots
        return all(map(operator.is_, map(dict.get, dicts, keys), objects)) and (
            list(map(torch.Tensor.data_ptr, self.tensors)) == self.pointers
        )

    def _module(self, parent, name: str):
        module = parent._modules.get(name)
        self._watch(parent._modules, name, module)
        return module

    def _watch(self, where: dict, name: str, value) -> None:
        self.slots[0].append(where)
        self.slots[1].append(name)
        self.slots[2].append(value)

    def _tensor(self, module, name: str, store: bool = True):
        """``module``'s parameter or buffer ``name`` (None where it has none), watched."""
        where = module._parameters if name in module._parameters else module._buffers
        t = where.get(name)
        self._watch(where, name, t)
        if t is not None:
            self.tensors.append(t)
            self.pointers.append(t.data_ptr())
        if store:
            self.addresses.append(0 if t is None else t.data_ptr())
        return t

    @classmethod
    def of(cls, model) -> _BlocksTable | None:
        """The table of ``model`` as it is; None where a layer is not of a kind the step takes."""
        import torch
        from torch import nn

        from gptkiln.model import MLP, CausalSelfAttention, Linear

        # int8 layers exist only once gptkiln.quantize is loaded (which imports this module's
        # users: importing it here would close a cycle)
        Int8Linear = getattr(sys.modules.get("gptkiln.quantize"), "Int8Linear", None)

        c = model.config
        self = cls()
        ln_f = self._module(model, "ln_f")
        if (
            c.n_embd % 16
            or c.mlp_size % 16
            or c.head_size % 16
            or c.head_size > 256
            or not isinstance(ln_f, nn.LayerNorm)
            or not _fp32_cpu(self._tensor(ln_f, "weight", False), self._tensor(ln_f, "bias", False))
        ):
            return None
        blocks = self._module(model, "h")
        caches = []
        for i in range(len(blocks)):
            block = self._module(blocks, str(i))
            attn, mlp = self._module(block, "attn"), self._module(block, "mlp")
            if (
                type(attn) is not CausalSelfAttention
                or not attn.use_sdpa
                or type(mlp) is not MLP
                or mlp.approximate != "tanh"
            ):
                return None
            for norm, parent, products in (
                ("ln_1", attn, ("c_attn", "c_proj")),
                ("ln_2", mlp, ("c_fc", "c_proj")),
            ):
                norm = self._module(block, norm)
                if not isinstance(norm, nn.LayerNorm) or norm.eps != ln_f.eps:
                    return None
                if not _fp32_cpu(self._tensor(norm, "weight"), self._tensor(norm, "bias")):
                    return None
                for name in products:
                    layer = self._module(parent, name)
                    if type(layer) is Linear:
                        w, s = self._tensor(layer, "weight"), self.addresses.append(0)
                        if w.dtype != torch.float32:
                            return None
                    elif Int8Linear is not None and type(layer) is Int8Linear:
                        w, s = self._tensor(layer, "weight"), self._tensor(layer, "scale")
                        if w.dtype != torch.int8 or not _fp32_cpu(s):
                            return None
                    else:
                        return None
                    b = self._tensor(layer, "bias")
                    if w.device.type != "cpu" or not w.is_contiguous() or not _fp32_cpu(b):
                        return None
                    self.products.append(layer)
            cache = self._module(attn, "kv_cache")
            if cache is None:
                return None
            k, v = self._tensor(cache, "k"), self._tensor(cache, "v")
            if (
                not _fp32_cpu(k, v)
                or k.shape != v.shape
                or k.shape[1:] != (c.n_head, k.size(2), c.head_size)
            ):
                return None
            caches.append(k.shape[:3:2])
        if len(set(caches)) != 1:  # every layer's cache alike: one number of rows and positions
            return None
        self.cache_rows, self.cache_len = caches[0]
        return self


def _fp32_cpu(*tensors) -> bool:
    """Every tensor given (None counts as absent) fp32, on the CPU and contiguous."""
    import torch

    return all(
        t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())
        for t in tensors
    )


def _avx512_on_linux() -> bool:
    import torch

    return (
        platform.system() == "Linux"
        and platform.machine() in ("x86_64", "AMD64")
        and torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")
    )


def compiler() -> str | None:
    """The C compiler: ``$CC``, else the first of cc, gcc, clang on the PATH; None: none."""
    named = os.environ.get("CC")
    if named:
        return shutil.which(named)
    return next((path for c in ("cc", "gcc", "clang") if (path := shutil.which(c))), None)


def load_built(name: str) -> ctypes.CDLL | None:
    """``csrc/NAME.c`` as a loaded shared library, built into the cache first where no loadable
    build of this source with this compiler is there; None where it cannot be built."""
    cc = compiler()
    if cc is None:
        return None
    source = SOURCES / f"{name}.c"
    try:  # the compiler as a file (a new one is another build), without running it
        real = os.path.realpath(cc)
        stat = os.stat(real)
    except OSError:
        return None
    compiled_by = f"{real} {stat.st_size} {stat.st_mtime_ns} {' '.join(FLAGS)}"
    # the other sources too: a file may include them (vexp.h; decode_blocks.c the loops)
    others = b"".join(
        f.read_bytes()
        for f in sorted(SOURCES.iterdir())
        if f.suffix in (".c", ".h") and f != source
    )
    digest = hashlib.sha256(source.read_bytes() + others + compiled_by.encode()).hexdigest()[:16]
    path = built_dir() / f"{name}-{digest}.so"
    if path.exists():
        try:
            return ctypes.CDLL(str(path))
        except OSError:  # truncated, or not a library: build it again
            pass
    if not _build(cc, source, path):
        return None
    for old in path.parent.glob(f"{name}-*.so"):  # builds of an earlier source or compiler
        if old != path:
            with contextlib.suppress(OSError):
                old.unlink()
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        return None


def built_dir() -> Path:
    """Where built libraries are kept: ``native/`` in gptkiln's cache directory."""
    from gptkiln.cache import cache_dir

    return cache_dir() / "native"


def _build(cc: str, source: Path, path: Path) -> bool:
    """Compile source into path, through a temporary file renamed into place; False on any
    failure (the compiler's messages are dropped: the kernels are an option, not a need)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".so.tmp", dir=path.parent)
        os.close(fd)
    except OSError:
        return False
    try:
        done = subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(source), "-lm"], capture_output=True, timeout=120
        )
        if done.returncode != 0:
            return False
        os.replace(tmp, path)
        return True
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
