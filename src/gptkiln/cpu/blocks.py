"""A decode step's blocks and final norm in one call of the library
(``csrc/generic/decode_blocks.c``: GPT-2's, and Llama 3's and Qwen3's), and what decides when a
model runs it.

With the products at the memory's speed, what was left of a GPT-2 124M decode step was the
interpreter: ~0.5 ms a block of views, norms, adds and the cache write around ~0.6 ms of
products. llama.cpp runs a step as one graph in C; `DecodeBlocks` runs the library's loops in
the same order from one call. It is a fused form of the kernels the tuner already chose, not
another model: GPT-2's modules stay the reference, the step is checked against them
(tests/test_native.py), and any layer it does not know sends the step back to them.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from gptkiln.cpu import specs
from gptkiln.cpu.library import library
from gptkiln.cpu.planned import few_row_kernels, own_class, plan_model
from gptkiln.cpu.products import bf16_copy
from gptkiln.sampling import DECODING

LOOP_KINDS = {spec.kernel: spec.loop for spec in specs.SPECS if spec.loop is not None}
"""The loops ``csrc/generic/decode_blocks.c`` runs, each by its number there (``KIND_*``)."""

BF16_LOOP = specs.BY_NAME["bf16_rows"].kernel


def in_one_call(layer: nn.Module, kernel) -> bool:
    """Whether the one-call step runs ``layer`` by ``kernel``: one of `LOOP_KINDS`, and
    ``q8_rows`` only where the layer's input is a multiple of 64 wide (elsewhere the q8 loop
    refuses it, and a step refused half-way is run again by the layers)."""
    q8 = specs.BY_NAME["q8_rows"].kernel
    return kernel in LOOP_KINDS and (kernel is not q8 or layer.weight.size(1) % 64 == 0)


FAMILIES = ("gpt2", "llama3", "qwen3")
"""The families whose decode step ``decode_blocks.c`` runs in one call."""


def block_products(model: nn.Module) -> list[nn.Module]:
    """A model's block products, in the order ``decode_blocks.c`` runs them: GPT-2's c_attn,
    c_proj, c_fc, c_proj a block; Llama's and Qwen3's q, k, v, o, gate, up, down."""
    if model.config.family == "gpt2":
        return [
            layer
            for block in model.h
            for layer in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
        ]
    return [
        layer
        for block in model.h
        for layer in (
            *(block.attn.q_proj, block.attn.k_proj, block.attn.v_proj, block.attn.o_proj),
            *(block.mlp.gate_proj, block.mlp.up_proj, block.mlp.down_proj),
        )
    ]


def use_native_blocks(model: nn.Module, rows: int) -> bool:
    """Give a ``model`` of one of `FAMILIES` the one-call decode step (`DecodeBlocks`: every
    block and the final norm of a step; the head keeps its tuned kernel) for steps of ``rows``
    rows, where every block product has one of the library's loops for that many rows
    (`in_one_call`):
    the step runs those loops from C instead of from Python one layer at a time, so it is
    offered only where they were chosen. Takes it away for ``rows`` otherwise. Returns whether
    the model has it for ``rows``.

    Measured on the 2-core Xeon, GPT-2 124M int8 at batch 1: 15.6 ms a step through the layers,
    ~6 ms of it outside the products; with the one call 7-8 ms (bench/README.md). The Qwen3-0.6B
    shape on one EPYC thread spent ~30 ms of an 83 ms bf16 step outside its 196 products."""
    if getattr(getattr(model, "config", None), "family", None) not in FAMILIES:
        return False
    native = all(
        in_one_call(layer, few_row_kernels(layer).get(rows)) for layer in block_products(model)
    ) and (library() is not None)
    blocks = getattr(model, "decode_blocks", None)
    if native:
        if blocks is None:
            blocks = plan_model(model).decode_blocks = DecodeBlocks(LOOP_KINDS)
        blocks.rows.add(rows)
    elif blocks is not None:
        blocks.rows.discard(rows)
    return native


class DecodeBlocks:
    """A model's blocks and final norm for one decode step, in one call of
    ``csrc/generic/decode_blocks.c`` (the library's ``gpt2_decode_blocks``, or
    ``llama_decode_blocks`` for Llama 3 and Qwen3, which also takes each row's RoPE rotation):
    it takes the place of `gptkiln.model.GPT.run_blocks` (the embedded tokens to ``ln_f``'s
    output, which the head turns into logits as before).

    Given to a model (its planned ``decode_blocks``, `gptkiln.cpu.planned.PlannedModel`) by
    `use_native_blocks` for the row
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
        self._tables: dict[bytes, _BlocksTable] = {}  # by the kinds of the products

    def __call__(self, model, x, start_pos: int, mask, rope=None):
        """ln_f(blocks(x)) for x (B, 1, C), the embedded new tokens at position ``start_pos``;
        ``mask`` None or the (B, 1, 1, S) bool mask of the keys each row may see; ``rope``
        (Llama, Qwen3) the cos and sin of each row's position, (1 or B, 1, 1, D) each. None
        where it does not take these."""
        B = x.size(0)
        lib = library() if B in self.rows else None
        c = model.config
        if (
            lib is None
            or c.family not in FAMILIES
            or (c.family != "gpt2") != (rope is not None)
            or (model.training and c.dropout > 0)
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or x.shape != (B, 1, c.n_embd)
        ):
            return None
        kernels = [few_row_kernels(layer).get(B) for layer in block_products(model)]
        if not DECODING.get() and any(getattr(k, "rounds", False) for k in kernels):
            return None  # rounding is a decoding's: another forward keeps the weights' numbers
        try:  # each product by the loop its layer has now (none of them: the layers run)
            kinds = bytes([self.loops[kernel] for kernel in kernels])
        except (KeyError, TypeError, AttributeError):
            return None
        table = self._tables.get(kinds)
        if table is None or not table.still(model):
            table = _BlocksTable.of(model, kinds)
            if table is None:
                return None
            self._tables[kinds] = table
        if B > table.cache_rows or start_pos >= table.cache_len:
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
        if rope is not None:
            return self._llama(lib, model, table, kinds, x, out, start_pos, mask, rope)
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

    def _llama(self, lib, model, table, kinds, x, out, start_pos, mask, rope):
        """``llama_decode_blocks`` for a Llama or Qwen3 model (`__call__`'s checks done)."""
        B, attn, D = x.size(0), model.h[0].attn, table.head_size
        try:  # each row's rotation, (B, D) contiguous: one position for all, or each its own
            cos, sin = (t.reshape(-1, D).expand(B, D).contiguous() for t in rope)
        except RuntimeError:
            return None
        if not _fp32_cpu(cos, sin):
            return None
        refused = lib.llama_decode_blocks(
            table.addresses.buffer_info()[0],
            kinds,
            len(model.h),
            x.data_ptr(),
            out.data_ptr(),
            B,
            model.config.n_embd,
            attn.n_head,
            attn.n_kv_head,
            D,
            table.mlp_size,
            table.cache_len,
            start_pos,
            None if mask is None else mask.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            model.ln_f.eps,
            model.ln_f.weight.data_ptr(),
            torch.get_num_threads(),
        )
        return None if refused else out


class _BlocksTable:
    """The addresses `DecodeBlocks` passes, 18 a block (``decode_blocks.c``'s order), and
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
        self.head_size = self.mlp_size = 0  # Llama / Qwen3: as the layers have them

    def still(self, model) -> bool:
        """Whether the model is as it was when these addresses were gathered."""
        import operator

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
    def of(cls, model, kinds: bytes) -> _BlocksTable | None:
        """The table of ``model`` as it is, for products run by ``kinds`` (a bf16 loop reads its
        layer's bf16 copy); None where a layer is not of a kind the step takes."""
        from gptkiln.model import MLP, CausalSelfAttention

        c = model.config
        if c.family != "gpt2":
            return cls._llama(model, kinds)
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
                own_class(attn) is not CausalSelfAttention
                or not attn.use_sdpa
                or own_class(mlp) is not MLP
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
                    if not self._product(self._module(parent, name), kinds):
                        return None
            if not self._cache(attn, c.n_head, c.head_size, caches):
                return None
        return self._caches_alike(caches)

    def _product(self, layer, kinds: bytes) -> bool:
        """The next product's addresses (weight or its bf16 copy, scale, bias) appended, as its
        kind in ``kinds`` reads them; False where the layer is not one the step takes."""
        from gptkiln.model import Linear

        # int8 layers exist only once gptkiln.quantize is loaded (which imports this module's
        # users: importing it here would close a cycle)
        Int8Linear = getattr(sys.modules.get("gptkiln.quantize"), "Int8Linear", None)
        kind = kinds[len(self.products)]
        if own_class(layer) is Linear and kind == LOOP_KINDS[BF16_LOOP]:
            w = self._tensor(layer, "weight", False)
            if w.dtype != torch.float32 or not w.is_contiguous():
                return False
            copy = bf16_copy(w)  # read in place of the weight: watched as it is
            self.tensors.append(copy)
            self.pointers.append(copy.data_ptr())
            self.addresses.append(copy.data_ptr())
            self.addresses.append(0)
        elif own_class(layer) is Linear:
            w, _ = self._tensor(layer, "weight"), self.addresses.append(0)
            if w.dtype != torch.float32:
                return False
        elif Int8Linear is not None and own_class(layer) is Int8Linear:
            w, s = self._tensor(layer, "weight"), self._tensor(layer, "scale")
            if w.dtype != torch.int8 or not _fp32_cpu(s):
                return False
        else:
            return False
        b = self._tensor(layer, "bias")
        if w.device.type != "cpu" or not w.is_contiguous() or not _fp32_cpu(b):
            return False
        self.products.append(layer)
        return True

    def _cache(self, attn, heads: int, head_size: int, caches: list) -> bool:
        """The layer's KV cache (keys, then values) appended: (B, heads, S_max, head_size)
        fp32 each; its (B, S_max) to ``caches``. False where it has none or another shape."""
        cache = self._module(attn, "kv_cache")
        if cache is None:
            return False
        k, v = self._tensor(cache, "k"), self._tensor(cache, "v")
        shape = (heads, k.size(2), head_size)
        if not _fp32_cpu(k, v) or k.shape != v.shape or k.shape[1:] != shape:
            return False
        caches.append(k.shape[:3:2])
        return True

    def _caches_alike(self, caches: list):
        """self, with every layer's cache alike (one number of rows and of positions); None
        where they differ."""
        if len(set(caches)) != 1:
            return None
        self.cache_rows, self.cache_len = caches[0]
        return self

    def _rms(self, norm, eps: float, size: int) -> bool:
        """A norm's weight appended; False where the norm is not a `RMSNorm` of ``size``
        features with ``eps``, its weight fp32 on the CPU."""
        from gptkiln.model import RMSNorm

        if own_class(norm) is not RMSNorm or norm.eps != eps or norm.weight is None:
            return False
        return _fp32_cpu(self._tensor(norm, "weight")) and norm.weight.shape == (size,)

    @classmethod
    def _llama(cls, model, kinds: bytes) -> _BlocksTable | None:
        """`of` for a Llama 3 or Qwen3 model: 27 addresses a block (``decode_blocks.c``'s
        ``L_*`` order)."""
        from gptkiln.model import Block, GroupedQueryAttention, SwiGLU

        c = model.config
        self = cls()
        ln_f = self._module(model, "ln_f")
        eps = getattr(ln_f, "eps", None)
        if eps is None or not self._rms(ln_f, eps, c.n_embd):
            return None
        self.addresses.pop()  # ln_f's weight is passed apart, not in a block's table
        blocks = self._module(model, "h")
        caches, shapes = [], set()
        for i in range(len(blocks)):
            block = self._module(blocks, str(i))
            attn, mlp = self._module(block, "attn"), self._module(block, "mlp")
            if (
                own_class(block) is not Block
                or own_class(attn) is not GroupedQueryAttention
                or not attn.use_sdpa
                or own_class(mlp) is not SwiGLU
                or mlp.relu2
            ):
                return None
            D, F = attn.head_size, mlp.gate_proj.weight.size(0)
            shapes.add((D, F))
            if c.n_embd % 16 or F % 16 or D % 16 or D > 256:
                return None
            if not self._rms(self._module(block, "ln_1"), eps, c.n_embd):
                return None
            for name in ("q_proj", "k_proj", "v_proj"):
                if not self._product(self._module(attn, name), kinds):
                    return None
            if attn.qk_norm:
                for name in ("q_norm", "k_norm"):
                    if not self._rms(self._module(attn, name), eps, D):
                        return None
            else:
                self.addresses.extend((0, 0))
            if not self._product(self._module(attn, "o_proj"), kinds):
                return None
            if not self._rms(self._module(block, "ln_2"), eps, c.n_embd):
                return None
            for name in ("gate_proj", "up_proj", "down_proj"):
                if not self._product(self._module(mlp, name), kinds):
                    return None
            if not self._cache(attn, attn.n_kv_head, D, caches):
                return None
        if len(shapes) != 1:
            return None
        ((self.head_size, self.mlp_size),) = shapes
        return self._caches_alike(caches)


def _fp32_cpu(*tensors) -> bool:
    """Every tensor given (None counts as absent) fp32, on the CPU and contiguous."""
    return all(
        t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())
        for t in tensors
    )
