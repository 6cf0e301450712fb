"""gptkiln's version, in a module of its own: the package's ``__init__`` is the top of the import
graph (it wires the features into loading, `gptkiln.load_steps`), so the modules below it read
the version here rather than import the package."""

__version__ = "0.1.0"
