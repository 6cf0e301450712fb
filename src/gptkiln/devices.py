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
