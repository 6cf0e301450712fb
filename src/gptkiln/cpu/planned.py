"""A model's layers as a decode plan runs them: each a subclass of the layer's own class, put on
the same object while the plan holds it and taken off again when the plan lets go.

The model (`gptkiln.model`) holds no hook for the CPU backend. A planned layer is the same
module (the same parameters, buffers, state dict keys and identity: a tied head stays tied, a
caller's reference stays good) whose class is swapped for a generated subclass, as
``torch.nn.utils.parametrize`` swaps a parametrized module's class; the subclass's methods run
the plan's kernels where a forward is one they take and hand everything else to the layer's
own method. Every one of them checks grad mode first: a forward with autograd (a training
step, compiled or not) runs the layer's own code exactly.

- a product (`gptkiln.model.Linear`, `gptkiln.quantize.Int8Linear`): ``few_row_kernels``, a
  number of rows -> the kernel for it (`ANY_ROWS`: for every other number, at a precision that
  rounds), used without autograd on the CPU in fp32;
- GPT-2's MLP (`gptkiln.model.MLP`, tanh GELU): ``c_fc``'s bias and the GELU in one pass of the
  library's loop (`gptkiln.cpu.loops.gelu_tanh_`), in place over the product's output;
- an SDPA attention layer (`gptkiln.model.Attention`): one new token a row by the library's
  decode attention (`gptkiln.cpu.loops.decode_attention`);
- the model (`gptkiln.model.GPT`): ``decode_blocks``, the one-call step of GPT-2, Llama 3 and
  Qwen3
  (`gptkiln.cpu.blocks.DecodeBlocks`), in place of `GPT.run_blocks` for one new token a row;
  ``decode_plan``, the `gptkiln.cpu.plan.DecodePlan` that holds the model.

`unplan` puts every layer of a model back as it was (class and attributes).
"""

from __future__ import annotations

import copyreg
import sys

import torch
import torch.nn.functional as F
from torch import nn

from gptkiln.cpu.library import library
from gptkiln.cpu.loops import decode_attention, gelu_tanh_
from gptkiln.model import MLP, Attention, Linear
from gptkiln.sampling import DECODING

_CLASSES: dict[tuple[type, type], type] = {}
"""(mixin, a layer's own class) -> the planned class made of them."""


class Planned:
    """What every planned class shares: the layer's own class (``unplanned``) and the
    attributes the plan gave the object (``planned_attributes``), both taken off by `unplan`."""

    unplanned: type
    planned_attributes: tuple[str, ...] = ()

    def __reduce_ex__(self, protocol):
        """Pickled (or deep-copied) as its own class without the plan's attributes: a plan is
        this process's (its kernels, weight copies, the library's addresses), and a model sent
        to another process arrives as it was before it."""
        reduced = list(super().__reduce_ex__(protocol))
        reduced[:2] = copyreg._reconstructor, (self.unplanned, object, None)  # no class check
        if isinstance(reduced[2], dict):
            skip = self.planned_attributes
            reduced[2] = {k: v for k, v in reduced[2].items() if k not in skip}
        return tuple(reduced)


def own_class(module: nn.Module) -> type:
    """The class ``module`` has when no plan holds it."""
    return module.unplanned if isinstance(module, Planned) else type(module)


def plan(module: nn.Module, mixin: type, **attributes) -> nn.Module:
    """Swap ``module``'s class for its planned one (``mixin`` over its own class) and give it
    ``attributes`` where it has none of them yet; the module, for chaining."""
    if not isinstance(module, mixin):
        base = own_class(module)
        if isinstance(module, Planned):
            unplan_layer(module)
        key = (mixin, base)
        cls = _CLASSES.get(key)
        if cls is None:
            name = f"Planned{base.__name__}"
            cls = _CLASSES[key] = type(name, (mixin, base), {"unplanned": base})
        module.__class__ = cls
    for name, value in attributes.items():
        if name not in module.__dict__:
            object.__setattr__(module, name, value)
    return module


def unplan_layer(module: nn.Module) -> None:
    """``module`` back to its own class, without the attributes its plan gave it."""
    if isinstance(module, Planned):
        for name in module.planned_attributes:
            module.__dict__.pop(name, None)
        module.__class__ = module.unplanned


def unplan(model: nn.Module) -> None:
    """Every layer of ``model`` back to its own class (`unplan_layer`)."""
    for module in model.modules():
        unplan_layer(module)


def is_product(module: nn.Module) -> bool:
    """Whether ``module`` is a product a plan may run by its kernels: a `gptkiln.model.Linear`
    or a `gptkiln.quantize.Int8Linear` (exactly: not a LoRA layer or another subclass)."""
    # int8 layers exist only once gptkiln.quantize is loaded (which imports this package:
    # importing it here would close a cycle)
    int8 = getattr(sys.modules.get("gptkiln.quantize"), "Int8Linear", None)
    return own_class(module) in (Linear, int8)


ANY_ROWS = -1
"""The key of a product's kernel for every number of rows no kernel of its own was given (a
prefill's many rows): the kernel of a precision that rounds on purpose, so that a forward
rounds alike whichever row counts were tuned before it (`gptkiln.cpu.tuner.round_at_any_rows`)."""


def few_row_kernels(layer: nn.Module) -> dict:
    """``layer``'s kernels by number of rows (`ANY_ROWS`: for the others; empty for a layer no
    plan gave any)."""
    return layer.__dict__.get("few_row_kernels", {})


def give_kernel(layer: nn.Module, rows: int, kernel) -> None:
    """Let ``layer`` (a product) run ``kernel`` for ``rows`` rows."""
    plan(layer, PlannedProduct, few_row_kernels={}).few_row_kernels[rows] = kernel


class PlannedProduct(Planned):
    """A product (``nn.Linear``'s ``(x, weight, bias)`` or an int8 layer's ``(x, weight, scale,
    bias)``) that runs ``few_row_kernels[rows]`` (else ``few_row_kernels[ANY_ROWS]``) for a
    forward of that many rows without autograd, on the CPU, with fp32 activations and the
    weights the kernels were tuned for (a kernel that rounds on purpose, inside a decoding
    only: `gptkiln.sampling.DECODING`); the layer's own forward otherwise."""

    planned_attributes = ("few_row_kernels",)
    few_row_kernels: dict

    def operands(self) -> tuple:
        scale = getattr(self, "scale", None)
        if scale is not None and self.weight.dtype == torch.int8:
            return self.weight, scale, self.bias
        return self.weight, self.bias

    def kernel_for(self, x: torch.Tensor):
        """The kernel for this forward, or None: the layer's own forward then."""
        if (
            torch.is_grad_enabled()
            or not self.few_row_kernels
            or x.device.type != "cpu"
            or torch.compiler.is_compiling()  # a traced graph takes the layer's own product
        ):
            return None
        tuned = self.scale if self.weight.dtype == torch.int8 else self.weight  # int8: the scales
        if x.dtype != torch.float32 or tuned.dtype != torch.float32:
            return None
        kernels = self.few_row_kernels
        kernel = kernels.get(x.numel() // self.in_features)
        kernel = kernels.get(ANY_ROWS) if kernel is None else kernel
        if getattr(kernel, "rounds", False) and not DECODING.get():
            return None  # rounding is a decoding's: another forward keeps the weights' numbers
        return kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # grad mode first: a compiled training step then never reads (or guards on) the dict
        kernel = None if torch.is_grad_enabled() else self.kernel_for(x)
        if kernel is not None:
            return kernel(x, *self.operands())
        return super().forward(x)


class PlannedGelu(Planned):
    """GPT-2's MLP with ``c_fc``'s bias and the tanh GELU in one in-place pass of the
    library's loop (`gptkiln.cpu.loops.gelu_tanh_`; the product then skips the bias: addmm
    would first copy it into every output row), for a forward without autograd on the CPU in
    fp32, outside ``torch.compile``; the MLP's own forward otherwise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            torch.is_grad_enabled()
            or x.device.type != "cpu"
            or x.dtype != torch.float32
            or torch.compiler.is_compiling()
        ):
            return super().forward(x)
        fc = self.c_fc
        plain = own_class(fc) is Linear and fc.bias is not None  # int8, LoRA: their own bias
        if plain:
            kernel = fc.kernel_for(x) if isinstance(fc, PlannedProduct) else None
            h = F.linear(x, fc.weight) if kernel is None else kernel(x, fc.weight, None)
        else:
            h = fc(x)
        bias = fc.bias if plain else None
        if not gelu_tanh_(h, bias):  # not a tensor it takes (another dtype, a view)
            h = F.gelu(h if bias is None else h + bias, approximate="tanh")
        return self.dropout(self.c_proj(h))


class PlannedAttention(Planned):
    """An SDPA attention layer whose step of one new token a row (no autograd, no attention
    weights asked, no dropout, outside ``torch.compile``) runs the library's decode attention
    (`gptkiln.cpu.loops.decode_attention`, SDPA's numbers up to rounding); `attend` otherwise."""

    def attend(self, q, k, v, start_pos, mask, attentions):
        if (
            not torch.is_grad_enabled()
            and q.size(2) == 1
            and attentions is None
            and not (self.training and self.dropout > 0)
            and not torch.compiler.is_compiling()
        ):
            y = decode_attention(q, k, v, mask)
            if y is not None:
                return y
        return super().attend(q, k, v, start_pos, mask, attentions)


class PlannedModel(Planned):
    """The model, with the plan that holds it (``decode_plan``) and its one-call step
    (``decode_blocks``, or None), which runs a step of one new token a row at one position
    (no autograd, every cache row, no attention weights asked, outside ``torch.compile``; with
    a loop that rounds, inside a decoding only: `gptkiln.sampling.DECODING`) in place of
    `gptkiln.model.GPT.run_blocks` where it takes the step. Each decode step runs on
    the plan's thread count (`gptkiln.cpu.threads.DecodeThreads`), every other forward on the
    full count; a step on another device, or traced by ``torch.compile`` (`gptkiln.gpu`'s
    graphs), is the model's own."""

    planned_attributes = ("decode_plan", "decode_blocks")
    decode_plan: object
    decode_blocks: object

    def run_blocks(self, x, start_pos, mask, rows, attentions, rope, values):
        threads = getattr(self.decode_plan, "threads", None)  # the count of a step's loops
        if threads is None or x.device.type != "cpu" or torch.compiler.is_compiling():
            return self._run_blocks(x, start_pos, mask, rows, attentions, rope, values)
        if x.size(1) != 1 or torch.is_grad_enabled():  # a prefill: every thread asked for
            threads.other_forward()
            return self._run_blocks(x, start_pos, mask, rows, attentions, rope, values)
        threads.begin_step(x.size(0))
        try:
            return self._run_blocks(x, start_pos, mask, rows, attentions, rope, values)
        finally:
            threads.end_step()

    def _run_blocks(self, x, start_pos, mask, rows, attentions, rope, values):
        blocks = self.decode_blocks
        if (
            blocks is not None
            and not values  # the one call has neither value embeddings nor windows
            and self.config.attention_windows is None
            and not torch.is_grad_enabled()
            and x.size(1) == 1
            and isinstance(start_pos, int)
            and rows is None
            and attentions is None
            and not torch.compiler.is_compiling()
        ):
            y = blocks(self, x, start_pos, mask, rope)
            if y is not None:
                return y
        return super().run_blocks(x, start_pos, mask, rows, attentions, rope, values)


def plan_model(model: nn.Module) -> nn.Module:
    """``model`` as a `PlannedModel` (no plan, no one-call step yet where it was not one)."""
    return plan(model, PlannedModel, decode_plan=None, decode_blocks=None)


def use_compiled_gelu(model: nn.Module) -> int:
    """Plan every MLP of ``model`` with GPT-2's tanh GELU to run the compiled loop of
    ``csrc/gelu.c`` (`gptkiln.cpu.loops.gelu_tanh_`: the bias of ``c_fc`` and the GELU in one
    pass over its output, in place), which it uses without autograd on the CPU in fp32.
    Returns how many MLPs took it: 0 where the library does not build (they keep ``F.gelu``).

    Measured on the 2-core Xeon, (4096, 3072): ``F.gelu`` 37 ms, the loop with the bias 4.7 ms;
    (16, 3072), a decode step's: 79 against 25 us. Its values are the tanh GELU's up to float
    rounding (within 5e-7 of each other over N(0, 3) inputs), so exact decoding keeps it."""
    mlps = [m for m in model.modules() if isinstance(m, MLP) and m.approximate == "tanh"]
    if not mlps or library() is None:
        return 0
    for mlp in mlps:
        plan(mlp, PlannedGelu)
    return len(mlps)


def use_compiled_attention(model: nn.Module) -> int:
    """Plan every SDPA attention layer of ``model`` to run the compiled decode-step attention of
    ``csrc/decode_attention.c`` (`gptkiln.cpu.loops.decode_attention`: one query a row over the KV
    cache, masks and grouped heads included), which it uses without autograd on the CPU in fp32
    where a step has one new token. Returns how many layers took it: 0 where the library does
    not build (they keep SDPA).

    Measured on the 2-core Xeon, GPT-2 124M's 12 heads of 64: batch 1 over 130 cached positions
    ~30 us a call against SDPA's ~90 us in a decode step (SDPA's flash kernel is built for blocks
    of queries). Its values are SDPA's up to float rounding (3e-7 apart in the tests), so exact
    decoding keeps it."""
    # a config's attention "math" asks for the explicit product (the book's): left as it is
    layers = [m for m in model.modules() if isinstance(m, Attention) and m.use_sdpa]
    if not layers or library() is None:
        return 0
    for layer in layers:
        plan(layer, PlannedAttention)
    return len(layers)


def use_compiled_loops(model: nn.Module) -> None:
    """`use_compiled_gelu` and `use_compiled_attention`: the project's compiled loops for
    forwards without autograd, where they build (decoding, prefill, scoring)."""
    use_compiled_gelu(model)
    use_compiled_attention(model)
