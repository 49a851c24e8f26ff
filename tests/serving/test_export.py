"""export_for and `ropescale patch --engine`: the files each engine is given, and refusals before
anything is written."""

import json
import os

import pytest
import torch
from click.testing import CliRunner

import ropescale
from cli import main
from ropescale.errors import InvalidInput, RopescaleError
from ropescale.serving import (
    ExportRefused,
    UnknownEngineError,
    compare,
    export_for,
    llama_cpp_rope,
    read_gguf_rope,
    ropescale_rope,
    vllm_rope,
)
from tests.serving.tiny_gguf import write_tiny_gemma3_gguf, write_tiny_llama_gguf

T, D = 32, 16  # tiny_model_dir's window and head_dim


@pytest.fixture
def run():
    runner = CliRunner()
    return lambda *args: runner.invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def loaded(tiny_model_dir):
    def _load(strategy, **params):
        model, tok = ropescale.load_model(str(tiny_model_dir), device="cpu")
        ropescale.patch(model, strategy, **params)
        return model, tok
    return _load


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory, tiny_model_dir):
    from transformers import AutoConfig

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("g") / "base.gguf", AutoConfig.from_pretrained(tiny_model_dir))


def test_transformers_target_raises_max_position_embeddings_to_the_served_length(loaded, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = loaded("yarn", factor=4.0)
    result = export_for(model, "transformers", 128, tmp_path / "yarn", tokenizer=tok)
    config = json.loads((result.path / "config.json").read_text())
    assert config["max_position_embeddings"] == 128 and config["rope_parameters"]["rope_type"] == "yarn"
    plain = AutoModelForCausalLM.from_pretrained(result.path).eval()
    ids = torch.arange(1, 100)[None]
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, model(ids).logits, atol=1e-5)
    model, tok = loaded("dynamic_ntk", factor=2.0)  # transformers' dynamic reads mpe as its window
    result = export_for(model, "transformers", 128, tmp_path / "dyn", tokenizer=tok)
    assert json.loads((result.path / "config.json").read_text())["max_position_embeddings"] == T
    assert any("kept at the training window" in n for n in result.notes)


def test_transformers_target_yarn_loads_without_the_implicit_factor_warning(loaded, tmp_path):
    import logging

    import transformers.utils.logging as hf_logging
    from transformers import AutoModelForCausalLM

    model, tok = loaded("yarn", factor=4.0)
    result = export_for(model, "transformers", 100, tmp_path / "yarn", tokenizer=tok)  # L != T·s
    assert json.loads((result.path / "config.json").read_text())["max_position_embeddings"] == T * 4
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    root = hf_logging.get_logger("transformers")
    hf_logging.warning_once.cache_clear()  # warned once per process otherwise
    root.addHandler(handler)
    try:
        plain = AutoModelForCausalLM.from_pretrained(result.path).eval()
    finally:
        root.removeHandler(handler)
    assert not [r for r in records if "implicit factor" in r.getMessage()]
    ids = torch.arange(1, 100)[None]
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, model(ids).logits)


def test_vllm_target_writes_the_config_vllm_json_and_the_patch_record(loaded, tmp_path):
    model, tok = loaded("ntk", factor=4.0)
    result = export_for(model, "vllm", 128, tmp_path / "ntk", tokenizer=tok)
    config = json.loads((result.path / "config.json").read_text())
    record = json.loads((result.path / "vllm.json").read_text())
    assert record["max_model_len"] == 128 and record["hf_overrides"]["max_position_embeddings"] == 128
    assert config["rope_parameters"]["rope_type"] == "default" and config["max_position_embeddings"] == 128
    assert compare(ropescale_rope(model, 128), vllm_rope(config, record["max_model_len"]), 128).same
    assert result.command == f"vllm serve {result.path} --max-model-len 128 --dtype float32"
    reloaded, _ = ropescale.load_model(str(result.path), device="cpu")  # ropescale.json still restores the patch
    assert ropescale.current_patch(reloaded).params == {"factor": 4.0}


def test_llama_cpp_engine_rewrites_the_given_gguf(loaded, tmp_path, base_gguf):
    model, _ = loaded("yarn", factor=4.0, attention_factor=1.2)
    result = export_for(model, "llama.cpp", 128, tmp_path / "out", gguf=base_gguf)
    assert result.path == tmp_path / "out" / "model.gguf" and result.engine == "llama.cpp"
    assert result.command == f"llama-cli -m {result.path} -c 128"
    kv, tensors = read_gguf_rope(result.path)
    assert compare(ropescale_rope(model, 128), llama_cpp_rope(kv, tensors, 128, D), 128).same


# ---- Gemma 3: per-layer-type rope parameters (main refused: "per-layer-type rotary patches ... are not exported") --

@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory, tiny_gemma3_dir):
    from transformers import AutoConfig

    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("g3") / "base.gguf",
                                  AutoConfig.from_pretrained(tiny_gemma3_dir))


@pytest.mark.parametrize("strategy", ["yarn:factor=4", "linear:factor=4"])
def test_cli_patch_gemma3_for_vllm_writes_each_layer_types_rope_and_transformers_reproduces_it(run, tmp_path,
                                                                                                tiny_gemma3_dir,
                                                                                                strategy):
    """``ropescale patch --engine vllm`` on Gemma 3 scales its global layers only, as vLLM reads the
    config (rope_parameters per layer type), and plain transformers loading the folder gives the
    patched model's logits at 4T."""
    from transformers import AutoModelForCausalLM

    res = run("patch", "--model", tiny_gemma3_dir, "--strategy", strategy, "--engine", "vllm",
              "--serve-length", "256", "-o", tmp_path / "v")
    assert res.exit_code == 0, res.output
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    rp = config["rope_parameters"]
    assert rp["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert rp["full_attention"]["rope_type"] == strategy.split(":")[0] and rp["full_attention"]["factor"] == 4.0
    assert rp["full_attention"]["rope_theta"] == 1000000.0 and config["max_position_embeddings"] == 256
    assert json.loads((tmp_path / "v" / "vllm.json").read_text())["max_model_len"] == 256
    assert f"vllm serve {tmp_path / 'v'} --max-model-len 256" in res.output
    model, _ = ropescale.load_model(str(tiny_gemma3_dir), device="cpu")
    name, _, factor = strategy.partition(":factor=")
    ropescale.patch(model, name, factor=float(factor))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "v", dtype=torch.float32).eval()
    ids = torch.arange(1, 257)[None] % 4000
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_cli_patch_gemma3_for_llama_cpp_writes_the_global_rope_keys_and_the_sliding_base(run, tmp_path,
                                                                                         tiny_gemma3_dir, gemma3_gguf):
    res = run("patch", "--model", tiny_gemma3_dir, "--strategy", "yarn:factor=4", "--engine", "llama.cpp",
              "--serve-length", "256", "--gguf", gemma3_gguf, "-o", tmp_path / "g")
    assert res.exit_code == 0, res.output
    kv, _ = read_gguf_rope(tmp_path / "g" / "model.gguf")
    assert kv["gemma3.rope.scaling.type"] == "yarn" and kv["gemma3.rope.scaling.factor"] == 4.0
    assert kv["gemma3.rope.scaling.original_context_length"] == 64 and kv["gemma3.rope.freq_base"] == 1e6
    assert kv["gemma3.rope.freq_base_swa"] == 10000.0 and kv["gemma3.attention.sliding_window"] == 16


def test_cli_a_gemma3_patch_of_the_sliding_layers_is_refused_for_llama_cpp_in_one_line(run, tmp_path,
                                                                                       tiny_gemma3_dir, gemma3_gguf):
    res = run("patch", "--model", tiny_gemma3_dir, "--strategy", "yarn:factor=4", "--layer-types",
              "sliding_attention,full_attention", "--engine", "llama.cpp", "--serve-length", "256", "--gguf",
              gemma3_gguf, "-o", tmp_path / "g")
    assert res.exit_code == 1
    last = res.output.rstrip("\n").split("\n")[-1]
    assert last.startswith("Error: llama.cpp: the llama.cpp of llama-cpp-python 0.3.36 rotates gemma3's "
                           "sliding-window layers at rope.freq_base_swa with no rope scaling"), res.output
    assert "patch full_attention only (--layer-types full_attention)" in last
    assert not (tmp_path / "g").exists()


def test_the_old_name_gguf_is_llama_cpp_with_one_deprecation_warning(loaded, tmp_path, base_gguf):
    """``gguf`` (the file format the llama.cpp target was named by) still exports, for old calls and
    configs: the same file as ``llama.cpp``, and one FutureWarning naming the new name at the caller."""
    import warnings

    model, _ = loaded("yarn", factor=4.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = export_for(model, "gguf", 128, tmp_path / "old", gguf=base_gguf)
    assert [str(w.message) for w in caught] == ["engine 'gguf' is deprecated; use 'llama.cpp'"]
    assert caught[0].category is FutureWarning and caught[0].filename == __file__
    new = export_for(model, "llama.cpp", 128, tmp_path / "new", gguf=base_gguf)
    assert old.engine == new.engine == "llama.cpp"
    assert old.path.read_bytes() == new.path.read_bytes()


def test_the_engine_is_named_engine_as_the_docs_and_the_cli_name_it(loaded, tmp_path):
    """``export_for(model, engine=..., ...)`` as docs/serving.md writes it (main: TypeError, the
    argument was still called ``target``) and ``result.engine``; the old keyword ``target=`` and
    ``result.target`` still work, each with one FutureWarning naming the caller's line."""
    import warnings

    model, tok = loaded("yarn", factor=4.0)
    result = export_for(model, engine="transformers", serve_length=128, output=tmp_path / "a", tokenizer=tok)
    assert result.engine == "transformers"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = export_for(model, target="transformers", serve_length=128, output=tmp_path / "b", tokenizer=tok)
        assert old.target == "transformers"
    assert [(str(w.message), w.category, w.filename) for w in caught] == [
        ("the argument target= is deprecated; use engine=", FutureWarning, __file__),
        ("ExportResult.target is deprecated; use ExportResult.engine", FutureWarning, __file__)]
    assert (tmp_path / "a" / "config.json").read_bytes() == (tmp_path / "b" / "config.json").read_bytes()
    with pytest.raises(InvalidInput, match="^engine='vllm' and target='vllm': target is the old name of engine; "
                                           "give one$"):
        export_for(model, "vllm", 128, tmp_path / "c", tokenizer=tok, target="vllm")
    assert not (tmp_path / "c").exists()


def test_refusals_and_bad_input_write_nothing(loaded, tmp_path, base_gguf):
    model, tok = loaded("rerope", window=8)
    with pytest.raises(ExportRefused, match="^vLLM: rerope"):
        export_for(model, "vllm", 128, tmp_path / "a", tokenizer=tok)
    with pytest.raises(ExportRefused, match="^llama.cpp: rerope"):
        export_for(model, "llama.cpp", 128, tmp_path / "a", gguf=base_gguf)
    assert not (tmp_path / "a").exists()
    model, tok = loaded("vanilla")
    with pytest.raises(UnknownEngineError, match="^unknown engine 'onnx'; known engines: llama.cpp, mlx, sglang, "
                                                 "transformers, vllm$"):
        export_for(model, "onnx", 128, tmp_path / "b", tokenizer=tok)
    for kwargs, match in [({"target": "llama.cpp"}, "^the llama.cpp engine rewrites an existing GGUF: .*--gguf"),
                          ({"target": "vllm", "tokenizer": None}, "tokenizer"),
                          ({"target": "vllm", "serve_length": None}, "serve_length")]:
        args = {"target": "vllm", "serve_length": 128, "tokenizer": tok} | kwargs
        with pytest.raises(InvalidInput, match=match):
            export_for(model, args.pop("target"), args.pop("serve_length"), tmp_path / "b", **args)
    assert not (tmp_path / "b").exists()


def test_cli_patch_target_vllm_prints_the_serve_line(run, tmp_path, tiny_model_dir):
    res = run("patch", "--model", tiny_model_dir, "--strategy", "llama3:factor=4", "--engine", "vllm",
              "--serve-length", "128", "-o", tmp_path / "l3")
    assert res.exit_code == 0, res.output
    assert f"vllm serve {tmp_path / 'l3'} --max-model-len 128" in res.output
    assert json.loads((tmp_path / "l3" / "vllm.json").read_text())["max_model_len"] == 128


def test_cli_patch_target_gguf(run, tmp_path, tiny_model_dir, base_gguf):
    res = run("patch", "--model", tiny_model_dir, "--strategy", "dynamic_ntk:factor=2", "--engine", "llama.cpp",
              "--serve-length", "128", "--gguf", base_gguf, "--freeze-dynamic-at", "96", "-o", tmp_path / "g")
    assert res.exit_code == 0, res.output
    assert "frozen at 96" in res.output and (tmp_path / "g" / "model.gguf").is_file()


@pytest.mark.parametrize(("args", "message"), [
    (("--strategy", "rerope:window=8", "--engine", "vllm", "--serve-length", "128"), "Error: vLLM: rerope is a"),
    (("--strategy", "yarn:factor=4,beta_fast=16", "--engine", "llama.cpp", "--serve-length", "128", "--gguf", "BASE"),
     "Error: llama.cpp: the llama architecture never reads"),
    (("--strategy", "vanilla", "--engine", "vllm"),
     "Error: the vllm engine serves one static rotation: give the length to serve (serve_length, --serve-length; "
     "tokens)"),
    (("--strategy", "vanilla", "--engine", "llama.cpp", "--serve-length", "64"),
     "Error: the llama.cpp engine rewrites an existing GGUF: give the unpatched model's (--gguf BASE.gguf)"),
])
def test_cli_refusals_are_one_line(run, tmp_path, tiny_model_dir, base_gguf, args, message):
    args = tuple(str(base_gguf) if a == "BASE" else a for a in args)
    res = run("patch", "--model", tiny_model_dir, *args, "-o", tmp_path / "x")
    assert res.exit_code == 1
    last = res.output.rstrip("\n").split("\n")[-1]  # after any "Loading weights" progress bar
    assert last.startswith(message), res.output


# ---- hostile input: refused in one line before anything is written (issue 26) --------------------

MAX = 1 << 24  # 2^24: float32 positions are exact integers up to here


def _last(res) -> str:
    """The CLI's last line (after any "Loading weights" progress bar)."""
    return res.output.rstrip("\n").split("\n")[-1]


# the engines by the one name the library and `ropescale patch --engine` give them
ENGINE = {"transformers": "transformers", "vllm": "vllm", "llama.cpp": "llama.cpp"}


def _serving(target, base_gguf) -> tuple:
    """The options a target needs besides the strategy."""
    return {"transformers": (), "vllm": ("--serve-length", 128),
            "llama.cpp": ("--serve-length", 128, "--gguf", base_gguf)}[target]


def _leftovers(folder):
    """Staging folders or write probes left anywhere under ``folder``."""
    return [p for p in folder.rglob("*") if "ropescale-export" in p.name or "ropescale-write-test" in p.name]


@pytest.mark.parametrize("target", ["transformers", "vllm", "llama.cpp"])
def test_freeze_dynamic_at_with_a_static_strategy_is_refused(run, tmp_path, tiny_model_dir, base_gguf, target):
    out = tmp_path / "x"
    res = run("patch", "--model", tiny_model_dir, "--strategy", "yarn:factor=4", "--engine", ENGINE[target],
              *_serving(target, base_gguf), "--freeze-dynamic-at", 64, "-o", out)
    assert res.exit_code == 1, res.output
    assert _last(res) == ("Error: freeze_dynamic_at=64 (--freeze-dynamic-at) applies to dynamic_ntk only; yarn is "
                          "static: its rotation does not depend on the length; leave it out")
    assert not out.exists()


def test_freeze_dynamic_at_with_longrope_is_refused(loaded, tmp_path):
    model, tok = loaded("longrope", factor=4.0, short_factor=[1.0] * (D // 2), long_factor=[2.0] * (D // 2))
    with pytest.raises(InvalidInput, match="^freeze_dynamic_at=64 .* longrope picks its short or long factors"):
        export_for(model, "vllm", 128, tmp_path / "x", tokenizer=tok, freeze_dynamic_at=64)
    assert not (tmp_path / "x").exists()


def test_freeze_dynamic_at_with_the_transformers_target_names_the_static_strategy(run, loaded, tmp_path,
                                                                                  tiny_model_dir):
    """transformers serves dynamic NTK dynamically (exact unfrozen): a frozen config.json would
    contradict ropescale.json, so it is refused, naming the static strategy with F's rotation."""
    out = tmp_path / "x"
    res = run("patch", "--model", tiny_model_dir, "--strategy", "dynamic_ntk:factor=2", "--freeze-dynamic-at", 64,
              "-o", out)
    assert res.exit_code == 1, res.output
    assert _last(res).startswith("Error: freeze_dynamic_at=64 (--freeze-dynamic-at) is for the engines that serve "
                                 "one static rotation (llama.cpp, mlx, sglang, vllm)")
    assert _last(res).endswith("patch ntk:factor=3.0 instead")  # s·F/T − (s − 1) = 2·64/32 − 1
    res = run("patch", "--model", tiny_model_dir, "--strategy", "dynamic_ntk:factor=2", "--freeze-dynamic-at", T,
              "-o", out)
    assert res.exit_code == 1 and _last(res).endswith("patch vanilla instead")  # F <= T: dynamic NTK is vanilla
    assert not out.exists()
    # what the message names rotates as dynamic NTK does at F: ropescale's two strategies agree
    dynamic, ntk = loaded("dynamic_ntk", factor=2.0)[0], loaded("ntk", factor=3.0)[0]
    assert torch.allclose(ropescale_rope(dynamic, 64).inv_freq, ropescale_rope(ntk, 64).inv_freq, rtol=1e-12, atol=0)
    assert not torch.allclose(ropescale_rope(dynamic, 63).inv_freq, ropescale_rope(ntk, 63).inv_freq, rtol=1e-6)


def test_a_plugin_freeze_hook_whose_static_form_transformers_cannot_write_is_one_line(loaded, tmp_path):
    """A dynamic plugin strategy frozen into a static strategy without an exporter (π/(2·n_max)) is refused in one
    line naming both, before any file is written, not a TypeError from deep in the plan."""
    from ropescale.strategies import REGISTRY, register
    from ropescale.strategies.frequency import vanilla

    @register("frozen_noexport_test", source="test", served="freeze",
              export=lambda params, context, base, mpe: {"rope_type": "dynamic", "factor": 2.0},
              freeze=lambda params, at, t: ("pi_over_2n", {"n_max": float(at)}))
    def dyn(dim, rope_theta, seq_len):
        return vanilla(dim, rope_theta)

    try:
        model, tok = loaded("frozen_noexport_test")
        with pytest.raises(ExportRefused, match=r"^strategy 'frozen_noexport_test' \(module .*\) frozen at 64 tokens "
                                                r"is pi_over_2n, which transformers rope parameters cannot express$"):
            export_for(model, "vllm", 128, tmp_path / "x", tokenizer=tok, freeze_dynamic_at=64)
        assert not (tmp_path / "x").exists()
    finally:
        REGISTRY.pop("frozen_noexport_test", None)


@pytest.mark.parametrize("target", ["transformers", "vllm"])
def test_a_gguf_given_to_a_folder_target_is_refused(run, tmp_path, tiny_model_dir, base_gguf, target):
    out = tmp_path / "x"
    res = run("patch", "--model", tiny_model_dir, "--strategy", "ntk:factor=4", "--engine", ENGINE[target],
              "--serve-length", 128, "--gguf", base_gguf, "-o", out)
    assert res.exit_code == 1, res.output
    assert _last(res) == (f"Error: a GGUF to rewrite (--gguf {base_gguf}) is read by the llama.cpp engine only; the "
                          f"{target} engine writes a model folder from the weights: leave --gguf out, or use "
                          "--engine llama.cpp")
    assert not out.exists()


@pytest.fixture
def model_copy(tmp_path, tiny_model_dir):
    """A model folder of this test's own (a failing test may write into it)."""
    import shutil

    return shutil.copytree(tiny_model_dir, tmp_path / "model")


@pytest.mark.parametrize("spelling", ["same", "dots", "output_symlink", "model_symlink"])
@pytest.mark.parametrize("target", ["transformers", "vllm", "llama.cpp"])
def test_the_model_folder_as_output_is_refused_for_every_target(run, tmp_path, model_copy, base_gguf, target,
                                                                spelling):
    before = {p.name: p.read_bytes() for p in model_copy.iterdir()}
    link = tmp_path / "link"
    link.symlink_to(model_copy, target_is_directory=True)
    model, out = {"same": (model_copy, model_copy), "dots": (model_copy, model_copy / ".." / "model" / "."),
                  "output_symlink": (model_copy, link), "model_symlink": (link, model_copy)}[spelling]
    res = run("patch", "--model", model, "--strategy", "ntk:factor=4", "--engine", ENGINE[target],
              *_serving(target, base_gguf), "-o", out)
    assert res.exit_code == 1, res.output
    assert _last(res) == (f"Error: output {out} is the model's own folder {model}: exporting there would overwrite "
                          "its config.json; choose another folder")
    assert {p.name: p.read_bytes() for p in model_copy.iterdir()} == before


def test_export_for_refuses_the_folder_the_model_was_loaded_from(tmp_path, model_copy):
    model, tok = ropescale.load_model(str(model_copy), device="cpu")
    ropescale.patch(model, "ntk", factor=4.0)
    (tmp_path / "link").symlink_to(model_copy, target_is_directory=True)
    with pytest.raises(RopescaleError, match="is the model's own folder"):
        export_for(model, "vllm", 128, tmp_path / "link", tokenizer=tok)
    assert "ntk" not in (model_copy / "config.json").read_text() and not (model_copy / "vllm.json").exists()


@pytest.mark.parametrize("flag", ["--serve-length", "--freeze-dynamic-at"])
@pytest.mark.parametrize("target", ["transformers", "vllm", "llama.cpp"])
def test_lengths_past_2_24_are_refused_for_every_target(run, tmp_path, tiny_model_dir, base_gguf, target, flag):
    out = tmp_path / "x"
    args = ["--serve-length", MAX + 1 if flag == "--serve-length" else 128,
            *(["--gguf", base_gguf] if target == "llama.cpp" else []),
            *(["--freeze-dynamic-at", MAX + 1] if flag == "--freeze-dynamic-at" else [])]
    res = run("patch", "--model", tiny_model_dir, "--strategy", "dynamic_ntk:factor=2", "--engine", ENGINE[target],
              *args, "-o", out)
    assert res.exit_code == 1, res.output
    name = flag[2:].replace("-", "_")
    assert _last(res) == (f"Error: {name}={MAX + 1} tokens is beyond any model: RoPE angles come from float32 "
                          "positions, exact only up to 2^24 = 16777216 tokens; use a length of at most 16777216")
    assert not out.exists()


def test_the_length_bound_is_2_24_inclusive_and_the_harness_s(loaded):
    from eval.config import MAX_LENGTH as HARNESS_MAX
    from ropescale.serving import export_vllm
    from ropescale.serving.rope import MAX_LENGTH

    assert MAX_LENGTH == HARNESS_MAX == 2 ** 24
    model, _ = loaded("ntk", factor=4.0)
    assert export_vllm(model, MAX).max_model_len == MAX
    with pytest.raises(InvalidInput, match="beyond any model"):
        export_vllm(model, MAX + 1)
    with pytest.raises(InvalidInput, match="beyond any model"):
        vllm_rope({"num_attention_heads": 2, "hidden_size": 32}, 10 ** 12)


@pytest.mark.parametrize("target", ["transformers", "vllm", "llama.cpp"])
def test_export_for_into_an_existing_file_is_one_line(loaded, tmp_path, base_gguf, target):
    model, tok = loaded("ntk", factor=4.0)
    taken = tmp_path / "taken"
    taken.write_text("mine")
    kwargs = {"tokenizer": tok} if target != "llama.cpp" else {"gguf": base_gguf}
    with pytest.raises(RopescaleError, match=f"^output {taken} is a file, not a folder$"):
        export_for(model, target, 128, taken, **kwargs)
    with pytest.raises(RopescaleError, match=f"^output {taken / 'sub'}: {taken} is a file, not a folder$"):
        export_for(model, target, 128, taken / "sub", **kwargs)
    assert taken.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


@pytest.mark.parametrize("target", ["transformers", "vllm", "llama.cpp"])
def test_a_read_only_output_is_refused_before_the_model_loads(run, tmp_path, tiny_model_dir, base_gguf, tmpfs,
                                                             target):
    ro = tmpfs("64k", read_only=True)
    res = run("patch", "--model", tiny_model_dir, "--strategy", "ntk:factor=4", "--engine", ENGINE[target],
              *_serving(target, base_gguf), "-o", ro / "x")
    assert res.exit_code == 1, res.output
    assert res.output == f"Error: output {ro / 'x'}: cannot write in {ro} (Read-only file system)\n"  # no loading


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes whatever the permissions")
@pytest.mark.parametrize("target", ["transformers", "vllm", "llama.cpp"])
def test_a_folder_without_write_permission_is_refused(run, tmp_path, tiny_model_dir, base_gguf, target):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        res = run("patch", "--model", tiny_model_dir, "--strategy", "ntk:factor=4", "--engine", ENGINE[target],
                  *_serving(target, base_gguf), "-o", locked / "x")
    finally:
        locked.chmod(0o755)
    assert res.exit_code == 1, res.output
    assert res.output == f"Error: output {locked / 'x'}: cannot write in {locked} (Permission denied)\n"


def _full_at_second_tensor(monkeypatch):
    """gguf's writer hits a full disk after the first tensor's data (ENOSPC, as the OS says it)."""
    import errno

    import gguf

    real, calls = gguf.GGUFWriter.write_tensor_data, []

    def write(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", write)
    return calls


def _full_weights(monkeypatch):
    """safetensors hits a full disk writing the weights: part of the file written, then its error."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    def save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 4096)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)


FULL = "could not be written (no space left on the device); it is left as it was, nothing half-written"


@pytest.mark.parametrize("target", ["transformers", "vllm", "llama.cpp"])
def test_a_full_disk_leaves_no_half_written_export(run, tmp_path, tiny_model_dir, base_gguf, monkeypatch, target):
    _full_at_second_tensor(monkeypatch) if target == "llama.cpp" else _full_weights(monkeypatch)
    out = tmp_path / "new" / "x"
    res = run("patch", "--model", tiny_model_dir, "--strategy", "ntk:factor=4", "--engine", ENGINE[target],
              *_serving(target, base_gguf), "-o", out)
    assert res.exit_code == 1, res.output
    assert _last(res) == f"Error: output {out / 'model.gguf' if target == 'llama.cpp' else out}: {FULL}"
    assert not (tmp_path / "new").exists()  # nor the parent made for it


@pytest.mark.parametrize("target", ["transformers", "vllm", "llama.cpp"])
def test_a_full_disk_leaves_an_existing_export_as_it_was(run, tmp_path, tiny_model_dir, base_gguf, monkeypatch,
                                                         target):
    out = tmp_path / "x"
    res = run("patch", "--model", tiny_model_dir, "--strategy", "linear:factor=2", "--engine", ENGINE[target],
              *_serving(target, base_gguf), "-o", out)
    assert res.exit_code == 0, res.output
    (out / "mine.txt").write_text("kept")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _full_at_second_tensor(monkeypatch) if target == "llama.cpp" else _full_weights(monkeypatch)
    res = run("patch", "--model", tiny_model_dir, "--strategy", "ntk:factor=4", "--engine", ENGINE[target],
              *_serving(target, base_gguf), "-o", out)
    assert res.exit_code == 1 and FULL in _last(res), res.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize(("target", "size"), [("transformers", "800k"), ("vllm", "800k"), ("llama.cpp", "300k")])
def test_a_real_full_disk_leaves_nothing(run, tmp_path, tiny_model_dir, base_gguf, tmpfs, target, size):
    """A tmpfs smaller than the export (weights 1.1 MB, GGUF 0.6 MB): the OS's own ENOSPC, through
    safetensors' and gguf's writers; afterwards the file system is as empty as before."""
    import shutil

    disk = tmpfs(size)
    out = disk / "x"
    res = run("patch", "--model", tiny_model_dir, "--strategy", "ntk:factor=4", "--engine", ENGINE[target],
              *_serving(target, base_gguf), "-o", out)
    assert res.exit_code == 1, res.output
    assert _last(res) == f"Error: output {out / 'model.gguf' if target == 'llama.cpp' else out}: {FULL}"
    assert list(disk.iterdir()) == [] and shutil.disk_usage(disk).used == 0


def test_an_export_into_an_existing_folder_replaces_its_files_and_keeps_the_others(run, tmp_path, tiny_model_dir):
    out = tmp_path / "x"
    assert run("patch", "--model", tiny_model_dir, "--strategy", "linear:factor=2", "-o", out).exit_code == 0
    mode = out.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o777 & ~umask  # a folder as mkdir makes it, not a temporary folder's 0700
    (out / "mine.txt").write_text("kept")
    assert run("patch", "--model", tiny_model_dir, "--strategy", "ntk:factor=4", "-o", out).exit_code == 0
    assert json.loads((out / "ropescale.json").read_text())["strategy"] == "ntk"
    assert (out / "mine.txt").read_text() == "kept" and not _leftovers(tmp_path)


@pytest.mark.parametrize("cut", [4, 100])  # gguf-py: IndexError in the counts, ValueError in the key/values
def test_cli_a_gguf_cut_short_is_one_line(run, tmp_path, tiny_model_dir, base_gguf, cut):
    short = tmp_path / "short.gguf"
    short.write_bytes(base_gguf.read_bytes()[:cut])
    res = run("patch", "--model", tiny_model_dir, "--strategy", "ntk:factor=4", "--engine", "llama.cpp",
              "--serve-length", 128, "--gguf", short, "-o", tmp_path / "x")
    assert res.exit_code == 1, res.output
    assert _last(res).startswith(f"Error: {short}: not a readable GGUF (cut short, corrupted or not a GGUF: ")
    assert not (tmp_path / "x").exists()
    res = run("parity", "--model", tiny_model_dir, "--strategy", "ntk:factor=4", "--lengths", 64, "--engines",
              "llama.cpp", "--gguf", short, "-o", tmp_path / "p")
    assert res.exit_code == 1, res.output
    assert _last(res).startswith(f"Error: {short}: not a readable GGUF (cut short, corrupted or not a GGUF: ")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("strategy, params", [("yarn", {"factor": 4.0, "attention_factor": 1.3}),
                                              ("longrope", {"factor": 4.0, "short_factor": [1.0] * (D // 2),
                                                            "long_factor": [1.0 + 0.4 * i for i in range(D // 2)]}),
                                              ("llama3", {"factor": 4.0})])
def test_mlx_engine_writes_mlx_lms_keys_and_transformers_still_reads_the_folder(loaded, tmp_path, strategy, params):
    """The MLX folder carries mlx-lm's transformers 4 keys (rope_theta, rope_scaling), which plain
    transformers 5 reads too: both give the patched model's logits at 4T, and ropescale.json the patch."""
    from transformers import AutoModelForCausalLM

    model, tok = loaded(strategy, **params)
    result = export_for(model, "mlx", 4 * T, tmp_path / "m", tokenizer=tok)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["rope_scaling"]["type"] == strategy and "rope_theta" in config
    assert json.loads((tmp_path / "m" / "mlx.json").read_text())["keys"]["rope_scaling"] == config["rope_scaling"]
    assert result.command == f"mlx_lm.server --model {result.path}"
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    reloaded, _ = ropescale.load_model(str(tmp_path / "m"), device="cpu")
    ids = torch.arange(1, 4 * T + 1)[None] % 200
    with torch.no_grad():
        want = model(ids).logits
        torch.testing.assert_close(plain(ids).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(reloaded(ids).logits, want, rtol=0, atol=1e-5)
