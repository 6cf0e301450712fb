"""Shared fixtures: the workplace's test corpora (../shared/data beside the repo)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _few_threads():
    # Tests are many tiny ops: more threads only add overhead on a 2-core runner.
    torch.set_num_threads(1)
    yield


@pytest.fixture
def verdict_path() -> Path:
    path = SHARED_DATA / "the-verdict.txt"
    if not path.exists():
        pytest.skip(f"{path} not present")
    return path


@pytest.fixture
def shakespeare_path() -> Path:
    path = SHARED_DATA / "tinyshakespeare.txt"
    if not path.exists():
        pytest.skip(f"{path} not present")
    return path
