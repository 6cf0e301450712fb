"""Where a model runs: device names as a person gives them, checked, for training and inference."""

from __future__ import annotations

import torch

from gptkiln.errors import GptkilnError


def resolve_device(spec: str = "auto") -> str:
    """``auto`` picks cuda, then mps, then cpu; any torch device string is used as given."""
    if spec != "auto":
        try:
            torch.device(spec)
        except RuntimeError as e:
            raise GptkilnError(
                f"--device {spec!r} is not a torch device ({e}); try cpu or cuda"
            ) from None
        if spec.startswith("cuda") and not torch.cuda.is_available():
            raise GptkilnError(f"--device {spec}: CUDA is not available here; use --device cpu")
        return spec
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def cpu_bf16_features() -> list[str]:
    """This CPU's instructions that make bf16 matmuls fast: ``"AMX"`` (Intel's tile matrix
    units, Sapphire Rapids and later) and ``"AVX512-BF16"`` (Cooper Lake, AMD Zen 4 and later);
    empty elsewhere. Asked of torch (what its kernels dispatch on), else of /proc/cpuinfo."""
    asks = (("AMX", "_is_amx_tile_supported", "amx_bf16"),
            ("AVX512-BF16", "_is_avx512_bf16_supported", "avx512_bf16"))  # fmt: skip
    flags: set[str] | None = None
    found = []
    for name, torch_check, flag in asks:
        check = getattr(torch.cpu, torch_check, None)
        if check is not None:
            has = bool(check())
        else:  # an older torch: the kernel's own flags
            flags = _cpuinfo_flags() if flags is None else flags
            has = flag in flags
        if has:
            found.append(name)
    return found


def _cpuinfo_flags() -> set[str]:
    """The flags of /proc/cpuinfo's first processor (empty where there is no such file)."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()
