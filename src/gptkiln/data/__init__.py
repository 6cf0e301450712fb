"""Data: sources of documents, tokenizing them to disk, and windows over the tokens.

source (txt / md / jsonl / json / parquet, .gz / .zst, folders, hf: datasets, Shakespeare)
  or a mixture of sources by weight (mixture.py)
  -> prepare(...)        train.bin, val.bin, meta.json, tokenizer files
  -> load_prepared(...)  read-only memmaps + meta + tokenizer
  -> SlidingWindowDataset / RandomWindowDataset / create_dataloader
"""

from gptkiln.data.mixture import Mixture, check_source, load_mixture, source_checksums
from gptkiln.data.prepare import PreparedData, load_prepared, prepare, token_dtype
from gptkiln.data.sources import iter_documents, iter_pieces, play_to_text
from gptkiln.data.windows import (
    RandomWindowDataset,
    SlidingWindowDataset,
    create_dataloader,
    windows_from_text,
)

__all__ = [
    "Mixture",
    "PreparedData",
    "RandomWindowDataset",
    "SlidingWindowDataset",
    "check_source",
    "create_dataloader",
    "iter_documents",
    "iter_pieces",
    "load_mixture",
    "load_prepared",
    "play_to_text",
    "prepare",
    "source_checksums",
    "token_dtype",
    "windows_from_text",
]
