"""The one way in: read a model directory of any format and build the GPT it holds.

Each format is a module that reads into the same two things, a `GPTConfig` and a state dict
with gptkiln's names and layouts (a `StoredModel`), over one set of checks:

==================  ===========================================================================
``load``            the entry points (`load_run`, `load_model`, `describe_weights`, ...) and
                    `format_of`: which format a directory is, from its config.json (one table)
``run``             a **gptkiln run** (``config.json`` with ``"format"`` and ``"model"``,
                    ``model.safetensors``, the tokenizer's files), written by `gptkiln.checkpoint`;
                    a quantized run too
``hf``              a **Hugging Face** directory's weights files, any family: model.safetensors,
                    its shards (model.safetensors.index.json), or pytorch_model.bin; the
                    tokenizer's files a conversion carries along
``hf_gpt2``         **Hugging Face GPT-2** (``"model_type": "gpt2"``): its config and names
``hf_llama``        **Hugging Face Llama and Qwen3** (``"model_type": "llama"`` / ``"qwen3"``,
                    gptkiln's families ``llama3`` / ``qwen3``): config (RoPE scaling, GQA,
                    head_dim, biases) and names; the tokenizer read from the directory
``book``            the **book's** ``model.pth`` (a state dict of its ``GPTModel``)
``checks``          names, shapes, dtypes and sizes against a config (`check_state_dict`), and a
                    built model against its use (`check_language_model`, `check_ids_fit`)
``files``           config.json, safetensors (memory-mapped, or its header), torch files
``build``           `build_model`: a `StoredModel` into a GPT on the meta device, tensors assigned
==================  ===========================================================================

A new Hugging Face family is a module beside ``hf_gpt2`` and ``hf_llama`` and one row in
`load.HF_FAMILIES`. A load then reads top to bottom::

    load_run(path)                       model, tokenizer, config.json
      └─ load_model(path)
           ├─ read_config                config.json, with errors a person can act on
           ├─ format_of(config.json)     which format is it?
           ├─ run.read                   a run:  GPTConfig from its "model" entry,
           │                                     read_safetensors (memory-mapped)
           ├─ hf_gpt2.read               HF:     config_from_hf, hf weights files (memory-mapped,
           │  (hf_llama.read)                    shards, or a torch file),
           │                                     hf_state_dict_to_gptkiln (names, Conv1D
           │                                     transposes, shapes checked)
           ├─ build_model                every name, shape and dtype checked against the config,
           │                             the GPT built on the meta device, the tensors assigned
           ├─ the load steps             a run's config.json entries that features complete
           │                             (`gptkiln.load_steps`: a LoRA run's adapters merged)
           └─ to(device, dtype); quantize="int8" quantizes a float model as it is loaded

Building on the meta device costs no memory and no initialisation, and assigning the
memory-mapped tensors copies nothing, so a load needs about one copy of the weights. A
**quantized run** (config.json records ``"quantization"``, `gptkiln.quantize`) is built the same
way: the meta model is quantized first (still no memory) and the int8 tensors are assigned, so
its load holds the int8 bytes and never a float copy.

Loading is below every feature and imports none of them: what a feature adds to a run (a LoRA
run's adapters) it adds through `gptkiln.load_steps`. Writing runs is `gptkiln.checkpoint`'s
job; writing other formats, `gptkiln.interop`'s.
"""

from gptkiln.loading.book import book_state_dict_to_gptkiln
from gptkiln.loading.build import StoredModel, build_model
from gptkiln.loading.checks import (
    check_config_fits,
    check_dtypes,
    check_ids_fit,
    check_language_model,
    check_shapes,
    check_state_dict,
    expected_shapes,
    weights_dims,
)
from gptkiln.loading.files import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    load_torch_file,
    read_config,
    read_safetensors,
    read_safetensors_header,
    safetensors_metadata,
)
from gptkiln.loading.hf import (
    HF_BIN_FILE,
    HF_INDEX_FILE,
    HF_TOKENIZER_FILES,
    hf_weights_files,
    read_hf_weights,
)
from gptkiln.loading.hf_gpt2 import CONV1D, config_from_hf, hf_state_dict_to_gptkiln
from gptkiln.loading.load import (
    HF_FAMILIES,
    describe_weights,
    format_of,
    load_book,
    load_hf,
    load_model,
    load_run,
    load_run_tokenizer,
    tokenizer_name,
)
from gptkiln.loading.run import FLOAT_FORMAT, FORMAT, QUANTIZED_FORMAT, run_model_config

__all__ = [
    "CONFIG_FILE",
    "CONV1D",
    "FLOAT_FORMAT",
    "FORMAT",
    "HF_BIN_FILE",
    "HF_FAMILIES",
    "HF_INDEX_FILE",
    "HF_TOKENIZER_FILES",
    "QUANTIZED_FORMAT",
    "WEIGHTS_FILE",
    "StoredModel",
    "book_state_dict_to_gptkiln",
    "build_model",
    "check_config_fits",
    "check_dtypes",
    "check_ids_fit",
    "check_language_model",
    "check_shapes",
    "check_state_dict",
    "config_from_hf",
    "describe_weights",
    "expected_shapes",
    "format_of",
    "hf_state_dict_to_gptkiln",
    "hf_weights_files",
    "load_book",
    "load_hf",
    "load_model",
    "load_run",
    "load_run_tokenizer",
    "load_torch_file",
    "read_config",
    "read_hf_weights",
    "read_safetensors",
    "read_safetensors_header",
    "run_model_config",
    "safetensors_metadata",
    "tokenizer_name",
    "weights_dims",
]
