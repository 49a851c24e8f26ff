"""export_for and `ropescale patch --target`: the files each engine is given, and refusals before
anything is written."""

import json

import pytest
import torch
from click.testing import CliRunner

import ropescale
from cli import main
from ropescale.errors import InvalidInput
from ropescale.serving import (
    ExportRefused,
    compare,
    export_for,
    llama_cpp_rope,
    read_gguf_rope,
    ropescale_rope,
    vllm_rope,
)
from tests.serving.tiny_gguf import write_tiny_llama_gguf

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


def test_gguf_target_rewrites_the_given_gguf(loaded, tmp_path, base_gguf):
    model, _ = loaded("yarn", factor=4.0, attention_factor=1.2)
    result = export_for(model, "gguf", 128, tmp_path / "out", gguf=base_gguf)
    assert result.path == tmp_path / "out" / "model.gguf"
    kv, tensors = read_gguf_rope(result.path)
    assert compare(ropescale_rope(model, 128), llama_cpp_rope(kv, tensors, 128, D), 128).same


def test_refusals_and_bad_input_write_nothing(loaded, tmp_path, base_gguf):
    model, tok = loaded("rerope", window=8)
    with pytest.raises(ExportRefused, match="^vLLM: rerope"):
        export_for(model, "vllm", 128, tmp_path / "a", tokenizer=tok)
    with pytest.raises(ExportRefused, match="^llama.cpp: rerope"):
        export_for(model, "gguf", 128, tmp_path / "a", gguf=base_gguf)
    assert not (tmp_path / "a").exists()
    model, tok = loaded("vanilla")
    for kwargs, match in [({"target": "onnx"}, "unknown export target"), ({"target": "gguf"}, "--gguf"),
                          ({"target": "vllm", "tokenizer": None}, "tokenizer"),
                          ({"target": "vllm", "serve_length": None}, "serve_length")]:
        args = {"target": "vllm", "serve_length": 128, "tokenizer": tok} | kwargs
        with pytest.raises(InvalidInput, match=match):
            export_for(model, args.pop("target"), args.pop("serve_length"), tmp_path / "b", **args)
    assert not (tmp_path / "b").exists()


def test_cli_patch_target_vllm_prints_the_serve_line(run, tmp_path, tiny_model_dir):
    res = run("patch", "--model", tiny_model_dir, "--strategy", "llama3:factor=4", "--target", "vllm",
              "--serve-length", "128", "-o", tmp_path / "l3")
    assert res.exit_code == 0, res.output
    assert f"vllm serve {tmp_path / 'l3'} --max-model-len 128" in res.output
    assert json.loads((tmp_path / "l3" / "vllm.json").read_text())["max_model_len"] == 128


def test_cli_patch_target_gguf(run, tmp_path, tiny_model_dir, base_gguf):
    res = run("patch", "--model", tiny_model_dir, "--strategy", "dynamic_ntk:factor=2", "--target", "gguf",
              "--serve-length", "128", "--gguf", base_gguf, "--freeze-dynamic-at", "96", "-o", tmp_path / "g")
    assert res.exit_code == 0, res.output
    assert "frozen at 96" in res.output and (tmp_path / "g" / "model.gguf").is_file()


@pytest.mark.parametrize(("args", "message"), [
    (("--strategy", "rerope:window=8", "--target", "vllm", "--serve-length", "128"), "Error: vLLM: rerope is a"),
    (("--strategy", "yarn:factor=4,beta_fast=16", "--target", "gguf", "--serve-length", "128", "--gguf", "BASE"),
     "Error: llama.cpp: the llama architecture never reads"),
    (("--strategy", "vanilla", "--target", "vllm"), "Error: --target vllm needs --serve-length"),
    (("--strategy", "vanilla", "--target", "gguf", "--serve-length", "64"), "Error: --target gguf rewrites"),
])
def test_cli_refusals_are_one_line(run, tmp_path, tiny_model_dir, base_gguf, args, message):
    args = tuple(str(base_gguf) if a == "BASE" else a for a in args)
    res = run("patch", "--model", tiny_model_dir, *args, "-o", tmp_path / "x")
    assert res.exit_code == 1
    last = res.output.rstrip("\n").split("\n")[-1]  # after any "Loading weights" progress bar
    assert last.startswith(message), res.output
