"""Training recipes: which parameters of the patched model train, what wraps it, and how the
result is saved — one module per recipe, each registering itself by its ``name``.

A recipe is a ``Recipe`` subclass with

- ``name`` (its name in configs: ``recipe: NAME`` or ``recipe: {name: NAME, option: value, ...}``),
- ``Options`` (a pydantic model of its options; unknown keys refused, each error naming the key),
- ``prepare(model, cfg, source) -> model``: called after the patch (and activation checkpointing)
  are applied; freezes / wraps and returns the model the optimiser trains (its parameters with
  ``requires_grad``),
- ``save(model, tokenizer, output, state_dict=None) -> Path``: writes the trained model (a folder
  ``ropescale.load_model`` reloads with its patch),
- optional ``label`` (added to the run's label), ``requires`` (modules that must be importable:
  checked when the config is read, one line naming the pip extra), ``shards`` (whether it combines
  with ``sharding``).

Adding a recipe is adding one module to this package: modules are imported on the first lookup
(``get_recipe`` / ``recipe_names``), as ``eval.tasks`` discovers its tasks; an installed package adds
one through the entry-point group ``ropescale.recipes`` (``ropescale.registry``). Bundled: ``full`` (all
weights, the default), ``lora`` (PEFT LoRA, also the ``lora:`` config section), ``longlora``
(LongLoRA's LoRA+, Chen et al. 2023, arXiv:2309.12307).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ropescale.errors import UnknownNameError
from ropescale.registry import Registry
from ropescale.runs.config import ConfigModel, NestedErrors, error_parts

__all__ = ["Recipe", "RecipeOptions", "UnknownRecipeError", "build_recipe", "get_recipe", "recipe_names"]


class UnknownRecipeError(UnknownNameError, ValueError):
    """No recipe of that name (the message lists the known ones)."""


class RecipeOptions(ConfigModel):
    """Options of a recipe without any (subclass for a recipe's own)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Recipe:
    """One way to train a patched model (see the package docstring). ``self.options``: the
    validated ``Options``. Subclasses with a ``name`` register themselves in ``RECIPES``."""

    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]] = RecipeOptions
    label: ClassVar[str] = ""
    requires: ClassVar[tuple[tuple[str, str], ...]] = ()  # (module, pip requirement)
    shards: ClassVar[bool] = True
    frozen_base: ClassVar[bool] = False  # the base weights do not train (they may load in bfloat16: `dtype`)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        RECIPES.add_class(cls)

    def __init__(self, options: BaseModel | None = None):
        self.options = options if options is not None else self.Options()

    def prepare(self, model, cfg, source: str = "config"):
        """The model to train, from the patched ``model`` (all parameters trainable on entry)."""
        raise NotImplementedError

    def save(self, model, tokenizer, output: str | Path, *, state_dict: dict | None = None) -> Path:
        """Write the trained ``model`` into ``output``; returns the folder. ``state_dict``: the
        gathered weights of a sharded model (None otherwise)."""
        raise NotImplementedError


RECIPES: Registry[type[Recipe]] = Registry("recipe", "recipes", UnknownRecipeError, package=__name__,
                                           plugins="ropescale.recipes")


def recipe_names() -> list[str]:
    """The registered recipes' names, sorted (plugins' included)."""
    return RECIPES.names()


def get_recipe(name: str) -> type[Recipe]:
    """The recipe class ``name``; ``UnknownRecipeError`` lists the known ones."""
    return RECIPES.lookup(name)


def build_recipe(name: str, options: dict[str, Any] | BaseModel | None = None) -> Recipe:
    """An instance of recipe ``name`` with validated ``options``. Raises ``ValueError`` in one
    line naming the option (``r: Input should be greater than or equal to 1``; a
    ``ropescale.runs.config.NestedErrors``), an unknown recipe or a missing package."""
    cls = get_recipe(name)
    for module, requirement in cls.requires:
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"{name}: needs {module}, which is not installed: pip install '{requirement}'")
    if isinstance(options, cls.Options):
        return cls(options)
    try:
        return cls(cls.Options.model_validate(options or {}))
    except ValidationError as e:  # the options' keys read as paths under the config's recipe key
        raise NestedErrors(error_parts(e, cls.Options)) from None
