"""The training recipes: YAML files of `TrainConfig` settings, bundled in src/gptkiln/recipes/
(``--config book-verdict``) or a file of one's own. Here, below the CLI, so that the trainer can
read a bundled one too (`gptkiln.train.task` names ``baseline`` to a resume that needs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptkiln.config.checks import check_values
from gptkiln.config.train import TrainConfig
from gptkiln.errors import GptkilnError

RECIPES_DIR = Path(__file__).parents[1] / "recipes"
"""The bundled recipes (``--config book-verdict``): src/gptkiln/recipes/*.yaml."""


def recipe_path(name_or_path: str) -> Path:
    """The file of a recipe: a path, or a bundled recipe's by its name (``book-verdict``)."""
    path = Path(name_or_path)
    if not path.is_file():
        bundled = RECIPES_DIR / f"{name_or_path}.yaml"
        if not bundled.is_file():
            names = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
            raise GptkilnError(
                f"--config {name_or_path}: no such file or bundled recipe; bundled recipes: {names}"
            )
        path = bundled
    return path


def load_recipe(name_or_path: str) -> dict[str, Any]:
    """A YAML training recipe: a bundled name (``book-verdict``) or a file path."""
    import yaml

    path = recipe_path(name_or_path)
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        problem = str(e).replace("\n", " ")
        raise GptkilnError(f"{path}: not valid YAML ({problem}); fix the file") from None
    if not isinstance(values, dict):
        raise GptkilnError(f"{path}: a recipe is a mapping of training settings (key: value)")
    return check_values(TrainConfig, values, str(path))
