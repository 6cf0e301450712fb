"""The library's loops for forwards without autograd, as torch functions: GPT-2's tanh GELU with
its bias (`gelu_tanh_`), one decode step's attention over the KV cache (`decode_attention`) and
the log-probability of one token a row for scoring (`target_log_probs`), each None or False
where the library does not load or the tensors are not of the kind it takes (the caller then
runs torch's own, the reference beside it). `gptkiln.cpu.planned.use_compiled_loops` plans a
model's MLPs and attention layers to run the first two.

`F.gelu`'s tanh took 37 ms on a (4096, 3072) expansion, more than the attention of that layer;
one pass that also adds ``c_fc``'s bias takes 4.7. At a decode step SDPA's flash kernel, built
for blocks of queries, cost ~90 us a layer at batch 1 where the keys and values of 130
positions take ~30 us to read and weigh. torch's ``log_softmax`` wrote a 200 MB tensor for
every 1,024 scored positions that the gather then read again, where one number a row is
needed: 84.6 -> 22.1 ms a chunk (2-core Xeon, bench/README.md).
"""

from __future__ import annotations

import torch

from gptkiln.cpu.library import library


def target_log_probs(logits, targets, with_argmax: bool):
    """``(log_softmax(logits)[n, targets[n]] for every row n, each row's argmax or None)`` by
    ``csrc/*/target_log_probs.c``: logits (N, V) fp32 on the CPU, rows of unit stride; targets (N,)
    int64. The argmax (only ``with_argmax``) is a row's first index where several tie, as
    ``torch.argmax``'s. Each row is read once from memory and no (N, V) log-softmax is written.

    None where the library is not (`gptkiln.cpu.library.library`) or the logits are not of that
    kind: the caller takes torch's ``log_softmax`` and ``gather`` (the reference,
    `gptkiln.evaluate._score_positions`)."""
    lib = library()
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
    """``y = gelu(y + bias)`` in place, GPT-2's tanh GELU, by ``csrc/*/gelu.c``: y (..., N) fp32
    on the CPU, contiguous; bias (N,) fp32 or None. False, and y untouched, where the library is
    not (`gptkiln.cpu.library.library`) or the tensors are not of that kind: the caller takes
    ``F.gelu``."""
    lib = library()
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
    query a row (a decode step) by ``csrc/*/decode_attention.c``: q (B, H, 1, D), k and v
    (B, G, S, D) with H a multiple of G (each key/value head serving H / G consecutive query
    heads), every tensor fp32 on the CPU with unit stride over D (views of the projections and
    of the KV cache are taken as they are), D a multiple of 16 up to 256; ``mask`` None or a
    bool tensor that broadcasts to (B, 1, 1, S), True where a key may be attended. Returns
    (B, H, 1, D), or None where the library is not (`gptkiln.cpu.library.library`) or the tensors
    are not of that kind: the caller takes SDPA."""
    lib = library()
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
