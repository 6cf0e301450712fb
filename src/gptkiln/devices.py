"""Where a model runs: device names as a person gives them, checked, for training and inference."""

from __future__ import annotations

import torch

from gptkiln.errors import GptkilnError


def resolve_device(spec: str = "auto") -> str:
    """``auto`` picks cuda, then mps, then cpu; any torch device string is used as given."""
    if spec != "auto":
        try:
            device = torch.device(spec)
        except RuntimeError as e:
            raise GptkilnError(
                f"--device {spec!r} is not a torch device ({e}); try cpu or cuda"
            ) from None
        _check_usable(spec, device)
        return spec
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _check_usable(spec: str, device: torch.device) -> None:
    """One line for a device torch names but this machine or build cannot run on: CUDA absent
    or a GPU index past the last; ``meta`` (shapes, no values); any other kind (mps, xpu, ...)
    that a tensor cannot be made on. CUDA is asked without making a tensor, which would open
    a context on the first GPU in every process of a torchrun launch."""
    if device.type == "cpu":
        return
    if device.type == "meta":
        raise GptkilnError(f"--device {spec}: holds shapes, not values; use --device cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise GptkilnError(f"--device {spec}: CUDA is not available here; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise GptkilnError(
                f"--device {spec}: this machine has {torch.cuda.device_count()} GPU(s), "
                f"cuda:0 to cuda:{torch.cuda.device_count() - 1}; give one of those"
            )
        return
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, NotImplementedError) as e:
        said = str(e).strip().splitlines()[0] if str(e).strip() else ""
        said = f" ({said})" if 0 < len(said) <= 100 else ""  # not the dispatcher's long list
        raise GptkilnError(
            f"--device {spec}: this torch build cannot run on {device.type} here{said}; use "
            "--device cpu"
        ) from None


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


def free_memory(device: str | torch.device) -> int | None:
    """Bytes the device has free now: the CPU's MemAvailable (Linux), a GPU's free memory; None
    where it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
