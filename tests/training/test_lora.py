"""LoRA through PEFT: the config, LongLoRA's "LoRA+" modules, the patch staying active inside the
PEFT wrapper, training that moves only the adapter (and with LoRA+ the embeddings and norms), and
both ways of saving — merged weights and an adapter folder — reloading through
``ropescale.load_model`` with the patch and the in-memory model's logits. Also bf16 on CPU."""

import copy
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import ropescale
from eval.config import ConfigError
from eval.finetune import run_finetune as finetune  # the CLI's path: training, then eval.after
from ropescale.training import build_finetune_config
from ropescale.training.loop import causal_lm_loss
from ropescale.training.lora import LoraSettings, apply_lora, embedding_and_norm_modules, save_trained
from ropescale.training.report import read_log
from tests.conftest import build, tiny_llama_config
from tests.training.test_config import cli, one_line_error, write  # noqa: F401 (write: fixture)
from tests.training.test_gradients import IDS

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # LoRA's, written out
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")




def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_lora_config_defaults_and_errors():
    base = {"strategy": "yarn", "length": 64, "steps": 1}
    cfg = build_finetune_config({**base, "lora": True}).lora
    assert (cfg.r, cfg.alpha, cfg.dropout, cfg.target_modules, cfg.modules_to_save, cfg.trainable_embeddings_norms,
            cfg.save) == (8, 16.0, 0.0, None, [], False, "merged")
    assert build_finetune_config({**base, "lora": False}).lora is None
    cfg = build_finetune_config({**base, "lora": {"r": 4, "target_modules": "q_proj, v_proj", "save": "adapter"}}).lora
    assert cfg.target_modules == ["q_proj", "v_proj"] and cfg.save == "adapter"
    for lora, message in [({"rank": 4}, "lora.rank: unknown key; allowed: r, alpha, dropout, target_modules, "
                                        "modules_to_save, trainable_embeddings_norms, save"),
                          ({"save": "full"}, "lora.save: Input should be 'merged' or 'adapter'"),
                          ({"target_modules": []}, "lora.target_modules: empty"),
                          ({"r": 0}, "lora.r: Input should be greater than or equal to 1")]:
        with pytest.raises(ConfigError) as e:
            build_finetune_config({**base, "lora": lora})
        assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_peft_is_one_line(write, tmp_path, monkeypatch):  # noqa: F811
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find(name, *a))
    one_line_error(cli(write(lora={"r": 4}), "-q", "-o", tmp_path / "out"),
                   "lora: needs PEFT, which is not installed: pip install 'ropescale[lora]'")


def test_unknown_target_module_is_one_line(write, tmp_path):  # noqa: F811
    one_line_error(cli(write(lora={"target_modules": ["qkv_proj"]}, eval=None), "-q", "-o", tmp_path / "out"),
                   "lora.target_modules: 'qkv_proj' matches no layer of the model",
                   "its linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj")
    assert not (tmp_path / "out").exists()


def test_a_target_among_others_that_matches_nothing_is_refused():
    """PEFT refuses targets only when none matches; one misspelled among good ones was dropped
    without a word (LoRA on q_proj only)."""
    model = build(LlamaForCausalLM, tiny_llama_config())
    with pytest.raises(ConfigError, match="lora.target_modules: 'v_prj' matches no layer"):
        apply_lora(model, LoraSettings(target_modules=["q_proj", "v_prj"]))


def test_the_rank_is_bounded_by_the_target_layers_smallest_dimension():
    """tiny_llama_config: hidden 64, 4 heads of head_dim 16, 2 KV heads — q_proj and o_proj are
    [64, 64], k_proj and v_proj [32, 64]: B A has rank at most 32 on the default targets, 64 on
    q_proj alone. r = 10^9 went to the allocator."""
    for targets, bound in [(None, 32), (["q_proj"], 64)]:
        model = build(LlamaForCausalLM, tiny_llama_config())
        wrapped = apply_lora(model, LoraSettings(r=bound, target_modules=targets))  # at the bound: trains
        assert {p.shape[0] for n, p in wrapped.named_parameters() if "lora_A" in n} == {bound}
        for r in (bound + 1, 10 ** 9):
            with pytest.raises(ConfigError, match=f"lora.r: rank {r} is above the smallest dimension of the target "
                                                  f"layers .*; use r <= {bound}$"):
                apply_lora(build(LlamaForCausalLM, tiny_llama_config()), LoraSettings(r=r, target_modules=targets))


def test_modules_to_save_that_match_nothing_are_refused():
    model = build(LlamaForCausalLM, tiny_llama_config())
    with pytest.raises(ConfigError, match="lora.modules_to_save: 'nrom' matches no module of the model"):
        apply_lora(model, LoraSettings(modules_to_save=["nrom"]))


def test_lora_plus_trains_what_longlora_trains():
    """LongLoRA's rule (``trainable_params="embed,norm"``): every parameter whose name contains
    ``embed`` or ``norm``. The modules given to PEFT hold exactly those parameters, and after
    wrapping exactly those and the LoRA matrices require gradients."""
    model = build(LlamaForCausalLM, tiny_llama_config())
    longlora = {n for n, _ in model.named_parameters() if "embed" in n or "norm" in n}
    names = embedding_and_norm_modules(model)
    assert {f"{m}.weight" for m in names} == longlora and len(names) == 1 + 2 * 2 + 1
    wrapped = apply_lora(model, LoraSettings(trainable_embeddings_norms=True))
    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    lora = {n for n in trainable if ".lora_" in n}
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    saved = {n.replace("base_model.model.", "", 1).replace(".modules_to_save.default", "") for n in trainable - lora}
    assert saved == longlora


@pytest.mark.parametrize("strategy,kwargs", [("yarn", {"factor": 2.0}), ("yarn", {"factor": 2.0, "logn": True}),
                                             ("rerope", {"window": 16})])
def test_the_patch_stays_active_inside_the_peft_model(strategy, kwargs):
    """At initialisation (B = 0) the LoRA model computes the patched model's logits — at 100 > T = 64
    tokens, where they differ from the unpatched model's."""
    model = build(LlamaForCausalLM, tiny_llama_config())
    with torch.no_grad():
        plain = model(IDS).logits
        handle = ropescale.patch(model, strategy, **kwargs)
        patched = model(IDS).logits
        wrapped = apply_lora(model, LoraSettings(trainable_embeddings_norms=True)).eval()
        assert ropescale.current_patch(wrapped) is handle
        assert torch.equal(wrapped(IDS).logits, patched) and rel(plain, patched) > 1e-3


def base_weights(folder) -> dict[str, torch.Tensor]:
    return load_file(next(iter(sorted(folder.glob("*.safetensors")))))


@pytest.mark.parametrize("save", ["merged", "adapter"])
@pytest.mark.parametrize("plus", [False, True], ids=["lora", "lora+"])
def test_lora_trains_only_its_weights_and_reloads_with_the_patch(tmp_path, tiny_model_dir, save, plus):
    torch.manual_seed(0)
    model, tokenizer = ropescale.load_model(str(tiny_model_dir), device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ropescale.patch(model, "yarn", factor=2.0)
    settings = LoraSettings(trainable_embeddings_norms=plus, save=save, dropout=0.1)
    peft = apply_lora(model, settings)
    peft.train()
    optimizer = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, len(tokenizer), (2, 64), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(6):
        loss = causal_lm_loss(peft, {"input_ids": ids})
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    state = peft.state_dict()
    for k, v in before.items():
        module, leaf = k.rsplit(".", 1)
        at = "base_model.model." + module
        frozen = [state[x] for x in (f"{at}.{leaf}", f"{at}.base_layer.{leaf}", f"{at}.original_module.{leaf}")
                  if x in state]
        assert len(frozen) == 1 and torch.equal(frozen[0], v), k  # the base weights never move
        trained = state.get(f"{at}.modules_to_save.default.{leaf}")
        assert (trained is not None) == (plus and ("embed" in k or "norm" in k)), k
        assert trained is None or not torch.equal(trained, v), k  # LoRA+: the trained copy moved
    assert all(state[k].abs().max() > 0 for k in state if ".lora_B." in k)  # B starts at 0 and moved
    peft.eval()
    with torch.no_grad():
        expected = peft(ids).logits
    save_trained(copy.deepcopy(peft) if save == "merged" else peft, tokenizer, tmp_path / "out", settings)
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert ("adapter_config.json" in files) == (save == "adapter") and "ropescale.json" in files
    reloaded, _ = ropescale.load_model(str(tmp_path / "out"), device="cpu")
    assert ropescale.current_patch(reloaded).strategy == "yarn"
    with torch.no_grad():
        got = reloaded(ids).logits
        assert rel(got, expected) <= 1e-5
        ropescale.unpatch(reloaded)
        assert rel(reloaded(ids).logits, expected) > 1e-4  # the patch mattered at 64 > T = 32
    if save == "adapter":
        stored = load_file(tmp_path / "out" / "adapter_model.safetensors")
        kinds = {"lora" if ".lora_" in k else k.split(".")[-2] for k in stored}
        assert kinds == ({"lora", "embed_tokens", "input_layernorm", "post_attention_layernorm", "norm"} if plus
                         else {"lora"})


def losses(output):
    return [r["loss"] for r in read_log(output) if "loss" in r]


def test_lora_runs_end_to_end_in_both_save_modes(tmp_path, tiny_run, tiny_model_dir):
    """Fine-tuning with LoRA+: the first step's loss is the fully trained run's (the same patched
    model at initialisation) and not vanilla RoPE's; the loss falls; merged and adapter runs train
    the same (bit-exact on CPU) and reload to the same logits; the harness evaluates the adapter
    folder after training to the PPL the run measured in memory; merged weights moved only in the
    LoRA-targeted layers, the embeddings and the norms."""
    heldout = tiny_run()["eval"]["data"]
    ev = {"every": 10, "data": heldout, "max_windows": 2, "lengths": [64]}
    lora = {"trainable_embeddings_norms": True, "r": 4}
    raw = tiny_run(strategy="yarn", steps=10, lr=1e-2, checkpoint_every=20, eval=None)
    runs = {"full": {**raw, "steps": 1}, "vanilla": {**raw, "steps": 1, "strategy": "vanilla", "lora": lora},
            "merged": {**raw, "lora": {**lora, "save": "merged"}},
            "adapter": {**raw, "lora": {**lora, "save": "adapter"},
                        "eval": {**ev, "after": [{"task": "perplexity", "lengths": [64], "max_windows": 2}]}}}
    out = {name: finetune(build_finetune_config(r), tmp_path / name, progress=False) for name, r in runs.items()}
    curve = losses(tmp_path / "merged")
    assert curve == losses(tmp_path / "adapter")
    # B = 0 adds exact zeros: the first loss is bit-equal to full fine-tuning's; vanilla RoPE's differs
    # (barely: the tiny random model's attention is near uniform, so it is compared exactly)
    assert curve[0] == losses(tmp_path / "full")[0] != losses(tmp_path / "vanilla")[0]
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3 - 0.05, curve  # 8.32 → 8.24 nats measured
    assert out["merged"]["trainable_parameters"] < out["full"]["trainable_parameters"] == out["full"]["parameters"]
    (record,) = out["adapter"]["evaluations"]["perplexity"]
    assert record["ppl"] == pytest.approx(out["adapter"]["ppl"]["64"], rel=1e-5)
    adapter_config = json.loads((tmp_path / "adapter" / "model" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(tiny_model_dir)
    models = {m: ropescale.load_model(str(tmp_path / m / "model"), device="cpu")[0] for m in ("merged", "adapter")}
    ids = torch.randint(0, 4096, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(models["adapter"](ids).logits, models["merged"](ids).logits) <= 1e-5
    base, merged = base_weights(tiny_model_dir), base_weights(tmp_path / "merged" / "model")
    assert base.keys() == merged.keys()
    moved = {k for k in base if not torch.equal(base[k], merged[k])}
    targeted = {"q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens", "input_layernorm",
                "post_attention_layernorm", "norm"}
    assert moved == {k for k in base if k.split(".")[-2] in targeted}


def test_bf16_on_cpu_with_checkpointing_and_lora(tmp_path, tiny_run):
    """mixed_precision bf16 (CPU autocast): LoRA+ with checkpointing trains the same with and
    without checkpointing and with the chunked or the model's own loss, within bf16 rounding of
    the float32 run, and keeps the adapter's weights float32."""
    raw = tiny_run(strategy="yarn", steps=3, lr=1e-2, eval=None, checkpoint_every=10,
                   lora={"trainable_embeddings_norms": True, "save": "adapter"})
    curves = {}
    for name, extra in {"fp32": {}, "bf16": {"mixed_precision": "bf16"},
                        "bf16+ckpt": {"mixed_precision": "bf16", "gradient_checkpointing": True},
                        "bf16+ckpt+plain": {"mixed_precision": "bf16", "gradient_checkpointing": True,
                                            "loss_chunk_size": 0}}.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            finetune(build_finetune_config({**raw, **extra}), tmp_path / name, progress=False)
        assert not [w for w in caught if "chunked LM head" in str(w.message)]  # no fallback to full logits
        curves[name] = losses(tmp_path / name)
    assert curves["bf16+ckpt"] == pytest.approx(curves["bf16"], rel=1e-5)
    assert curves["bf16+ckpt+plain"] == pytest.approx(curves["bf16"], rel=1e-5)
    assert curves["bf16"] != curves["fp32"]  # autocast was on
    assert curves["bf16"] == pytest.approx(curves["fp32"], rel=2e-2)
    stored = load_file(tmp_path / "bf16+ckpt" / "model" / "adapter_model.safetensors")
    assert {v.dtype for v in stored.values()} == {torch.float32}


MEMORY_STACK = {"activation_offload": True, "tiled_mlp": 2, "tiled_norms": True, "mixed_precision": "bf16",
                "dtype": "bfloat16"}


@pytest.mark.parametrize("stack", [{}, MEMORY_STACK], ids=["plain", "memory-stack"])
def test_a_killed_lora_run_resumes_to_the_same_adapter(tmp_path, tiny_run, stack):
    """With LoRA dropout: the resumed run draws the masks the uninterrupted one draws (the data
    loader's seed draw took one number from the global RNG after the checkpoint's state was
    restored, so the masks from step 3 on differed). With the long-context memory options too
    (offload, both tilings, a bf16 base under autocast): bit for bit."""
    if stack:
        pytest.importorskip("deepspeed")
    raw = tiny_run(strategy="yarn", steps=4, lr=1e-2, eval=None, checkpoint_every=2, gradient_checkpointing=True,
                   lora={"trainable_embeddings_norms": True, "save": "adapter", "dropout": 0.1}, **stack)
    finetune(build_finetune_config(raw), tmp_path / "straight", progress=False)
    assert finetune(build_finetune_config(raw), tmp_path / "killed", progress=False, stop_after=3)["model"] is None
    assert finetune(build_finetune_config(raw), tmp_path / "killed", progress=False)["resumed_from"] == 2
    a, b = (load_file(tmp_path / run / "model" / "adapter_model.safetensors") for run in ("straight", "killed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


KILLABLE = """
import pathlib, sys, time
from ropescale.training import loop

real, calls = loop.causal_lm_loss, []


def loss(*a, **k):  # one call per optimiser step (grad_accum 1): step 4 waits to be killed
    calls.append(1)
    if len(calls) == 4:
        pathlib.Path(sys.argv[1]).write_text("in step 4")
        time.sleep(600)
    return real(*a, **k)


loop.causal_lm_loss = loss
from cli import main

main(sys.argv[2:])
"""


def test_a_lora_run_killed_with_sigkill_resumes_to_the_uninterrupted_adapter(tmp_path, tiny_run):
    """A real ``kill -9`` (no handler runs) in step 4 of a LoRA+ run checkpointed at step 2: the
    rerun resumes from step 2 and saves the adapter the uninterrupted run saves, bit for bit."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    raw = tiny_run(strategy="yarn", steps=4, lr=1e-2, eval=None, checkpoint_every=2,
                   lora={"trainable_embeddings_norms": True, "save": "adapter", "dropout": 0.1})
    cfg, marker, killed = tmp_path / "ft.yaml", tmp_path / "marker", tmp_path / "killed"
    cfg.write_text(json.dumps(raw))
    (tmp_path / "killable.py").write_text(KILLABLE)
    # as many threads as this process trains with: the same reductions, bit-exact results
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(torch.get_num_threads()),
           "PYTHONPATH": str(root)}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "killable.py"), str(marker), "finetune", str(cfg), "-q",
                             "-o", str(killed)], env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), proc.communicate(timeout=5)[1].decode()[-3000:]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "model").exists() and (killed / "checkpoints" / "step-000002").is_dir()
    assert [r["step"] for r in read_log(killed)] == [1, 2, 3]
    resumed = finetune(build_finetune_config(raw), killed, progress=False)
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 4
    finetune(build_finetune_config(raw), tmp_path / "straight", progress=False)
    a, b = (load_file(tmp_path / run / "model" / "adapter_model.safetensors") for run in ("straight", "killed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert read_log(killed) == [{**r, "tokens_per_s": x["tokens_per_s"]} if "loss" in r else r
                                for r, x in zip(read_log(tmp_path / "straight"), read_log(killed))]


# the two-process LoRA run: tests/training/test_distributed.py (it shares that module's one launch)


def test_an_adapter_folder_without_a_patch_record_takes_its_base_models_window(tmp_path, tiny_model_dir):
    from ropescale.models import model_training_window

    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model_dir)}))
    assert model_training_window(str(tmp_path)) == 32
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ropescale.models.ModelLoadError, match="names no base_model_name_or_path"):
        model_training_window(str(tmp_path))


def _float32_activation_copies(model, batch, hidden: int) -> tuple[int, torch.Tensor, dict]:
    """One bf16-autocast step of ``model``: how many float32 copies of [·, s, hidden] activations the
    step makes (``aten._to_copy`` to float32 of a tensor with ``hidden`` columns and more than one
    row per position), the loss, and the adapters' gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and out.dtype == torch.float32 and out.dim() == 3 \
                    and out.shape[-1] == hidden and args[0].dtype == torch.bfloat16:
                Copies.count += 1
            return out

    model.zero_grad()
    with Copies(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = causal_lm_loss(model, batch, chunk_size=16)
        loss.backward()
    return Copies.count, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_under_autocast_the_adapters_take_the_activations_without_a_float32_copy():
    """A bfloat16 base under bf16 autocast: PEFT casts each adapter's input to float32 and autocast casts it
    straight back, so switching the cast off (``apply_lora(..., autocast=True)``) gives the same loss and
    gradients bit for bit, without those float32 copies (one per adapted layer's input in forward). The
    trainable weights are float32 either way."""
    results = {}
    for autocast in (False, True):
        model = build(LlamaForCausalLM, tiny_llama_config()).to(torch.bfloat16)
        model = apply_lora(model, LoraSettings(target_modules=["q_proj", "o_proj"]), autocast=autocast)
        for n, p in model.named_parameters():
            if "lora_B" in n:  # B starts at zero: give the adapters a path for the gradient of A
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(1))
        assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
        results[autocast] = _float32_activation_copies(model, {"input_ids": IDS}, model.config.hidden_size)
    (copies_cast, loss_cast, grads_cast), (copies, loss, grads) = results[False], results[True]
    # the cast's copies: q_proj's and o_proj's inputs in each layer, and gradients on their way back (the
    # rest are the RMSNorms' own float32)
    assert copies_cast - copies >= 2 * model.config.num_hidden_layers
    assert torch.equal(loss, loss_cast)
    assert set(grads) == set(grads_cast) and len(grads) == 4 * model.config.num_hidden_layers
    for n in grads:
        assert torch.equal(grads[n], grads_cast[n]), n


def test_a_bfloat16_base_trains_lora_in_mixed_precision(tmp_path, tiny_run, tiny_model_dir):
    """``dtype: bfloat16`` loads the frozen base in bfloat16, the adapters train in float32, and the loss
    follows the float32 base's bf16 run within bf16 rounding. Saved merged, the run keeps its training:
    every targeted weight reloads as the bf16 base (upcast) + B A · alpha / r from the same run saved as an
    adapter, within float32 rounding (measured ≤ 1.6e-7 of the update; merged in bf16: 7e-3 here, 0.87 in
    the run of issue 52); config.json says float32; the other weights are the bf16 base's exactly."""
    raw = tiny_run(strategy="yarn", steps=3, lr=1e-2, eval=None, checkpoint_every=10, mixed_precision="bf16",
                   lora={"save": "merged", "r": 4, "alpha": 8.0})
    b16 = {**raw, "dtype": "bfloat16"}
    finetune(build_finetune_config(raw), tmp_path / "f32", progress=False)
    finetune(build_finetune_config(b16), tmp_path / "b16", progress=False)
    finetune(build_finetune_config({**b16, "lora": {**raw["lora"], "save": "adapter"}}), tmp_path / "adapter",
             progress=False)
    assert losses(tmp_path / "b16") == pytest.approx(losses(tmp_path / "f32"), rel=2e-2)
    assert losses(tmp_path / "b16") != losses(tmp_path / "f32")  # the base really was bfloat16
    assert losses(tmp_path / "adapter") == losses(tmp_path / "b16")  # the same training, saved both ways
    assert build_finetune_config({**raw, "dtype": "float32"}).identity() == build_finetune_config(raw).identity()
    assert build_finetune_config(b16).identity() != build_finetune_config(raw).identity()

    base = {k: v.to(torch.bfloat16).float() for k, v in base_weights(tiny_model_dir).items()}
    ab = load_file(tmp_path / "adapter" / "model" / "adapter_model.safetensors")
    updates = {k: ab[f"base_model.model.{k[:-len('weight')]}lora_B.weight"].double()
               @ ab[f"base_model.model.{k[:-len('weight')]}lora_A.weight"].double() * (8.0 / 4)
               for k in base if k.split(".")[-2] in DEFAULT_TARGETS}
    assert len(updates) == 4
    reloaded, _ = ropescale.load_model(str(tmp_path / "b16" / "model"), device="cpu")
    merged = reloaded.state_dict()
    for k, update in updates.items():
        assert merged[k].dtype == torch.float32, k
        assert float(update.norm()) > 0, k
        err = float((merged[k].double() - (base[k].double() + update)).norm() / update.norm())
        assert err <= 1e-6, (k, err)
    assert all(torch.equal(merged[k], base[k]) for k in base if k not in updates)
    config = json.loads((tmp_path / "b16" / "model" / "config.json").read_text())
    assert config["dtype"] == "float32"


@pytest.mark.parametrize("extra, fragment", [
    ({"lora": True}, "dtype: bfloat16 computes under autocast: set mixed_precision: bf16"),
    ({"mixed_precision": "bf16"}, r"dtype: bfloat16 is for a frozen base \(lora, longlora\); recipe full"),
])
def test_a_bfloat16_base_needs_lora_and_mixed_precision(tiny_run, extra, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build_finetune_config(tiny_run(dtype="bfloat16", **extra))


def test_a_4bit_base_is_refused_in_one_line_where_bitsandbytes_cannot_run(tiny_run):
    """QLoRA's ``dtype: nf4`` (bitsandbytes, CUDA): on the CPU — given, or what ``device: auto`` resolves to on
    this machine — one line before anything loads; on a CUDA device without bitsandbytes, the install line."""
    raw = tiny_run(lora=True, mixed_precision="bf16", dtype="nf4")
    with pytest.raises(ConfigError, match="dtype: nf4 quantizes the base with bitsandbytes on a CUDA device; this run "
                                          "is on cpu"):
        build_finetune_config(raw)
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: device auto resolves to it")
    with pytest.raises(ConfigError, match="dtype: nf4 quantizes the base .* this run is on cpu"):
        build_finetune_config({**raw, "device": "auto"})
    if __import__("importlib").util.find_spec("bitsandbytes") is None:
        with pytest.raises(ConfigError, match=r"dtype: nf4 needs bitsandbytes: pip install 'ropescale\[qlora\]'"):
            build_finetune_config({**raw, "device": "cuda"})
    with pytest.raises(ConfigError, match="dtype: nf4 is for a frozen base"):
        build_finetune_config({**raw, "lora": None, "device": "cuda"})


def test_only_nf4_quantization_is_known(tiny_model_dir):
    from ropescale.models import load_model

    with pytest.raises(ValueError, match="quantization 'int3' unknown; the one there is: nf4"):
        load_model(str(tiny_model_dir), quantization="int3", device="cpu")
