"""The longlora recipe (ropescale/training/recipes/longlora.py) against LongLoRA's own code
(dvlab-research/LongLoRA fine-tune.py, written out below): the same parameters train; end to end
it trains as LoRA+ does and reloads."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

import ropescale
from eval.finetune import run_finetune as finetune
from ropescale.runs.config import ConfigError
from ropescale.training import build_finetune_config
from ropescale.training.recipes import get_recipe, recipe_names
from ropescale.training.report import read_log
from tests.conftest import build, tiny_llama_config

# the oracle wraps with PEFT directly, which reads a property transformers 5.24 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")


def longlora_reference(model, trainable_params="embed,norm"):
    """LongLoRA fine-tune.py (low_rank_training, a Llama model), unchanged but for the arguments."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    config = LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    [p.requires_grad_() for n, p in model.named_parameters() if any([k in n for k in trainable_params.split(",")])]
    return model


def trainable(model):
    """Trainable parameter names with PEFT's modules_to_save copy folded onto the module's name."""
    return {n.replace(".modules_to_save.default", ""): p.numel()
            for n, p in model.named_parameters() if p.requires_grad}


def test_the_recipe_trains_what_longlora_trains():
    assert "longlora" in recipe_names()
    ours = get_recipe("longlora")().prepare(build(LlamaForCausalLM, tiny_llama_config()), cfg=None)
    theirs = longlora_reference(build(LlamaForCausalLM, tiny_llama_config()))
    assert trainable(ours) == trainable(theirs)
    names = set(trainable(ours))
    assert any("embed_tokens" in n for n in names) and any(n.endswith("model.norm.weight") for n in names)
    assert any("lora_A" in n for n in names) and not any("lm_head" in n or "mlp" in n for n in names)


def test_options_and_errors():
    base = {"strategy": "yarn", "length": 64, "steps": 1}
    recipe = build_finetune_config({**base, "recipe": {"name": "longlora", "r": 4, "trainable_params": "embed"}})
    assert recipe.training_recipe().options.trainable_params == ["embed"]
    with pytest.raises(ConfigError) as e:
        build_finetune_config({**base, "recipe": {"name": "longlora", "target_modules": ["q_proj"]}})
    assert "recipe.target_modules: unknown key; allowed: r, alpha" in str(e.value)
    with pytest.raises(ConfigError, match="recipe.trainable_params: List should have at least 1 item"):
        build_finetune_config({**base, "recipe": {"name": "longlora", "trainable_params": []}})


def test_trainable_params_matching_no_parameter_are_refused_naming_the_names():
    """LongLoRA's rule trains what LoRA trains plus the parameters whose name contains a pattern; a
    pattern in no name (a typo, or ``embed`` on GPT-2, whose embeddings are ``wte``) trained
    nothing more without a word."""
    from transformers import GPT2Config, GPT2LMHeadModel

    recipe = get_recipe("longlora")
    model = build(LlamaForCausalLM, tiny_llama_config())
    with pytest.raises(ConfigError) as e:
        recipe(recipe.Options(trainable_params=["embed", "nrom"])).prepare(model, None)
    assert "recipe.trainable_params: 'nrom' is in no parameter name of the model" in str(e.value)
    assert "e.g. model.embed_tokens.weight" in str(e.value) and "post_attention_layernorm" in str(e.value)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    assert not any("embed" in n or "norm" in n for n, _ in gpt2.named_parameters())  # the premise
    with pytest.raises(ConfigError, match="'embed', 'norm' are in no parameter name .* wte"):
        recipe().prepare(gpt2, None)


def test_longlora_runs_as_lora_plus_and_reloads(tmp_path, tiny_run):
    """On a Llama model LongLoRA's name rule picks the modules LoRA+ picks by class: the same loss
    curve as ``lora: {trainable_embeddings_norms: true}``; the adapter reloads with its patch."""
    raw = tiny_run(strategy="yarn", steps=3, lr=1e-2, eval=None, checkpoint_every=10)
    a = finetune(build_finetune_config({**raw, "recipe": {"name": "longlora", "save": "adapter"}}), tmp_path / "a",
                 progress=False)
    b = finetune(build_finetune_config({**raw, "lora": {"trainable_embeddings_norms": True}}), tmp_path / "b",
                 progress=False)
    curve = [r["loss"] for r in read_log(tmp_path / "a") if "loss" in r]
    assert curve == [r["loss"] for r in read_log(tmp_path / "b") if "loss" in r]
    assert a["trainable_parameters"] == b["trainable_parameters"] < a["parameters"]
    assert a["label"].endswith(" + LongLoRA")
    assert (tmp_path / "a" / "model" / "adapter_config.json").is_file()
    model, _ = ropescale.load_model(str(tmp_path / "a" / "model"), device="cpu")
    merged, _ = ropescale.load_model(str(tmp_path / "b" / "model"), device="cpu")
    ids = torch.randint(0, 4096, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, merged(ids).logits, rtol=0, atol=1e-4)
