"""Runs out of gptkiln and models in: one module per format.

- `hf`: a run → a Hugging Face directory (``transformers`` loads it alone), any tokenizer.
- `gguf`: a run → one GGUF file (llama.cpp, Ollama, LM Studio), and a GGUF file → a run.
- `ollama`: the Modelfile written beside a GGUF.
- `templates`: a run's chat template as jinja; `files`: atomic copies and stale files.
"""
