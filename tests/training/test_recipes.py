"""Training recipes (ropescale.training.recipes): discovered by module, chosen by ``recipe:``
(``lora:`` still meaning the lora recipe), options validated per recipe in one line naming the
key, and used by the loop to prepare and save the model."""

import pytest
from pydantic import Field

from eval.finetune import run_finetune as finetune
from ropescale.runs.config import ConfigError
from ropescale.training import build_finetune_config
from ropescale.training.recipes import RECIPES, Recipe, RecipeOptions, get_recipe, recipe_names
from ropescale.training.report import read_log

BASE = {"strategy": "yarn", "length": 64, "steps": 1}


def test_bundled_recipes_are_discovered():
    assert {"full", "lora"} <= set(recipe_names())
    assert get_recipe("full").name == "full" and get_recipe("lora").label == " + LoRA"


@pytest.mark.parametrize("recipe,message", [
    ("lorra", "config: recipe: unknown recipe 'lorra' (did you mean 'lora'?); known recipes: full, "),
    ({"name": "lora", "rank": 4}, "config: recipe.rank: unknown key; allowed: r, alpha"),
    ({"name": "lora", "r": 0}, "config: recipe.r: Input should be greater than or equal to 1"),
    ({"name": "full", "r": 4}, "config: recipe.r: unknown key; allowed: none"),
    (3, "config: recipe: a recipe name"),
])
def test_bad_recipes_are_one_line_naming_the_key(recipe, message):
    with pytest.raises(ConfigError) as e:
        build_finetune_config({**BASE, "recipe": recipe})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_lora_section_is_the_lora_recipe():
    by_section = build_finetune_config({**BASE, "lora": {"r": 4, "save": "adapter"}}).training_recipe()
    by_recipe = build_finetune_config({**BASE, "recipe": {"name": "lora", "r": 4, "save": "adapter"}}).training_recipe()
    assert type(by_section) is type(by_recipe) and by_section.options == by_recipe.options
    assert build_finetune_config(BASE).training_recipe().name == "full"
    assert "recipe" not in build_finetune_config(BASE).identity()  # earlier runs' manifests stay valid
    with pytest.raises(ConfigError, match="lora: the lora section is the lora recipe; recipe: lora is also given"):
        build_finetune_config({**BASE, "lora": True, "recipe": "lora"})
    with pytest.raises(ConfigError, match="sharding: not combined with lora"):
        build_finetune_config({**BASE, "recipe": "lora", "sharding": "fsdp", "device": "cuda"})


def test_recipe_lora_trains_exactly_as_the_lora_section(tmp_path, tiny_run):
    raw = tiny_run(strategy="yarn", steps=3, lr=1e-2, eval=None, checkpoint_every=10)
    a = finetune(build_finetune_config({**raw, "lora": {"r": 4}}), tmp_path / "a", progress=False)
    b = finetune(build_finetune_config({**raw, "recipe": {"name": "lora", "r": 4}}), tmp_path / "b", progress=False)
    curve = [r["loss"] for r in read_log(tmp_path / "a") if "loss" in r]
    assert curve == [r["loss"] for r in read_log(tmp_path / "b") if "loss" in r]
    assert a["trainable_parameters"] == b["trainable_parameters"] < a["parameters"]
    assert a["label"] == b["label"] and a["label"].endswith(" + LoRA")


def test_a_recipe_defined_anywhere_is_used_by_the_loop(tmp_path, tiny_run):
    """A subclass registers itself; the loop trains what its prepare leaves trainable and saves
    through its save."""
    saved = []

    class HeadOnlyOptions(RecipeOptions):
        note: str = Field("x")

    class HeadOnly(Recipe):
        name = "test-head-only"
        Options = HeadOnlyOptions
        label = " + head only"

        def prepare(self, model, cfg, source="config"):
            for n, p in model.named_parameters():
                p.requires_grad_(n.startswith("lm_head"))
            return model

        def save(self, model, tokenizer, output, *, state_dict=None):
            saved.append(self.options.note)
            return get_recipe("full")().save(model, tokenizer, output, state_dict=state_dict)

    try:
        raw = tiny_run(steps=2, eval=None, checkpoint_every=10, recipe={"name": "test-head-only", "note": "y"})
        out = finetune(build_finetune_config(raw), tmp_path, progress=False)
        assert saved == ["y"] and out["label"].endswith(" + head only")
        assert out["trainable_parameters"] < out["parameters"]
    finally:
        RECIPES.pop("test-head-only", None)
