"""`ropescale conformance`: the shipped configs build tiny with every rope key as shipped, the model's own
rotation (`model_ropes`) against transformers' formulas written out, the sampled positions against the
full table, and one known non-conformance (SGLang's Gemma 3) found end to end without any engine
installed. The real engines' cells: docs/results-parity.md (`ropescale conformance`)."""

import json
import math
import sys

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import ropescale
from cli import main
from eval.conformance import LENGTH_CAP, build_tiny, load_shipped, markdown, run_conformance, shipped_names, tiny_config
from eval.engines.base import angle_table_diff, sampled_positions
from eval.parity import AS_SHIPPED
from ropescale.errors import InvalidInput, OutputError
from ropescale.serving.rope import model_ropes

# the families the issue names, each with a config of its own
NAMED = {"gemma-3-4b", "gemma-4", "gpt-oss-20b", "llama-4-scout", "ministral-3-8b", "deepseek-v3", "phi-3.5-mini",
         "qwen3-8b-yarn4", "qwen3.5-mrope-yarn4", "qwen2.5-7b-1m", "exaone-4.0-32b", "smollm3-3b"}
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "rope_local_base_freq", "head_dim", "qk_rope_head_dim",
             "partial_rotary_factor", "original_max_position_embeddings", "max_position_embeddings", "sliding_window",
             "dual_chunk_attention_config", "attn_temperature_tuning", "floor_scale", "attn_scale")


def test_every_family_the_issue_names_has_a_shipped_config():
    assert set(shipped_names()) >= NAMED and len(shipped_names()) >= 12


@pytest.mark.parametrize("name", sorted(NAMED))
def test_the_tiny_model_keeps_every_rope_key_and_transformers_reads_the_same_rope(name, tmp_path):
    entry = load_shipped(name)
    tiny = tiny_config(entry)
    for key in ROPE_KEYS:
        assert tiny.get(key) == entry.config.get(key), key
    n = tiny["num_hidden_layers"]
    for key in ("layer_types", "no_rope_layers"):  # the pattern's first period, unchanged
        if key in entry.config:
            assert tiny[key] == entry.config[key][:n]
    folder = build_tiny(entry, tmp_path / name)
    assert json.loads((folder / "config.json").read_text()) == tiny  # as shipped, not transformers' rewrite
    # transformers standardizes the tiny config's rope exactly as the full one's
    full = AutoConfig.for_model(**{k: v for k, v in entry.config.items() if k != "model_type"},
                                model_type=entry.config["model_type"])
    assert AutoConfig.from_pretrained(folder).rope_parameters == full.rope_parameters
    assert 2 <= entry.length <= LENGTH_CAP


def test_unknown_or_malformed_shipped_configs_are_one_line(tmp_path):
    with pytest.raises(InvalidInput, match="not a shipped config") as e:
        load_shipped("gemma-9")
    assert "\n" not in str(e.value)
    bad = tmp_path / "bad.json"
    bad.write_text('{"hub": "x"}')
    with pytest.raises(InvalidInput, match="not a shipped-config JSON object") as e:
        load_shipped(str(bad))
    assert "\n" not in str(e.value)


def _yarn_inv_freq(base, d, s, t, beta_fast=32.0, beta_slow=1.0):
    """YaRN's frequencies written out (Peng et al. 2023, arXiv:2309.00071, eq. 19–23; truncated ramp)."""
    inv = [base ** (-2 * i / d) for i in range(d // 2)]

    def dim(rot):  # the pair whose wavelength fits `rot` turns in t tokens
        return d * math.log(t / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(dim(beta_fast)), 0), min(math.ceil(dim(beta_slow)), d - 1)
    out = []
    for i, f in enumerate(inv):
        ramp = min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0)
        out.append(f / s * ramp + f * (1 - ramp))
    return torch.tensor(out, dtype=torch.float64)


def test_model_ropes_is_the_models_own_yarn_and_longrope():
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=256,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 64})
    model = AutoModelForCausalLM.from_config(cfg).eval()
    (lt, got), = model_ropes(model, 200).items()
    assert lt is None
    assert torch.allclose(got.inv_freq, _yarn_inv_freq(10000.0, 32, 4.0, 64), rtol=1e-6)
    assert got.magnitude == pytest.approx(0.1 * math.log(4.0) + 1, rel=1e-6)
    short, long = [1.0 + 0.1 * i for i in range(16)], [1.0 + i for i in range(16)]
    cfg.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long,
                           "original_max_position_embeddings": 64}
    model = AutoModelForCausalLM.from_config(cfg).eval()
    base = torch.tensor([10000.0 ** (-2 * i / 32) for i in range(16)], dtype=torch.float64)
    for length, factors in ((32, short), (200, long)):  # LongRoPE switches past T = 64
        got = model_ropes(model, length)[None]
        assert torch.allclose(got.inv_freq, base / torch.tensor(factors, dtype=torch.float64), rtol=1e-6)


def test_native_parity_reads_a_per_layer_type_model_type_by_type(tmp_path):
    folder = build_tiny(load_shipped("gemma-3-4b"), tmp_path / "g")
    model, _ = ropescale.load_model(str(folder), device="cpu")
    with ropescale.patch(model, "native") as handle:
        ropes = ropescale.serving.rope.ropescale_layer_ropes(handle, 100)
    base = torch.tensor([10000.0 ** (-2 * i / 256) for i in range(128)], dtype=torch.float64)
    assert torch.allclose(ropes["sliding_attention"].inv_freq, base, rtol=1e-6)  # the local base, unscaled
    assert torch.allclose(ropes["full_attention"].inv_freq,
                          base ** (math.log(1e6) / math.log(1e4)) / 8, rtol=1e-5)  # base 10^6, linear x8


@pytest.mark.parametrize("length", [2, 4096, 4097, 131072])
def test_sampled_positions_keep_what_the_verdict_needs(length):
    got = sampled_positions(length)
    if length <= 4096:
        assert got is None
        return
    assert got == sorted(set(got)) and got[:1024] == list(range(1024)) and got[-1] == length - 1
    assert len(got) < 1200


def test_angle_table_diff_on_sampled_positions_is_the_full_tables_on_those_rows():
    theta = torch.tensor([1.0, 0.01, 1e-4], dtype=torch.float64)
    wrong = theta * torch.tensor([1.0, 1.0, 1.001], dtype=torch.float64)
    m = torch.arange(5000, dtype=torch.float64)[:, None] * wrong[None]
    rows = sampled_positions(5000)
    cos, sin = torch.cos(m), torch.sin(m)
    assert angle_table_diff(cos[rows], sin[rows], theta, rows) == pytest.approx(
        angle_table_diff(cos, sin, theta), rel=1e-9)
    assert angle_table_diff(cos[rows], sin[rows], theta, rows) == pytest.approx(4999 * 1e-7, rel=1e-6)


def test_sglangs_gemma3_is_found_not_to_apply_the_shipped_linear_scaling(tmp_path):
    """SGLang 0.5.23's gemma3_causal.py overwrites the rope type with ``default``: the 4B's linear x8 on the
    global layers is lost (8x too fast), which the conformance run reports without SGLang installed."""
    cells, meta = run_conformance(["gemma-3-4b"], engines=["transformers", "sglang"], output=tmp_path, length=512)
    shipped = {c.engine: c for c in cells if c.exported_by == AS_SHIPPED}
    assert shipped["transformers"].kind == "same"
    sg = shipped["sglang"]
    assert sg.kind == "differs" and "full_attention" in sg.text and "sliding_attention" not in sg.text
    assert sg.max_rel_freq_diff == pytest.approx(7.0, rel=1e-5)  # 1 / (1/8) − 1
    ours = {c.engine: c for c in cells if c.exported_by != AS_SHIPPED}
    assert ours["sglang"].kind == "cannot express"  # ropescale's export refuses what SGLang would drop
    table = markdown(cells, meta)
    assert "| `gemma-3-4b` |" in table and "**differs**: full_attention" in table


def test_cli_unknown_config_is_one_line_exit_1(tmp_path):
    res = CliRunner().invoke(main, ["conformance", "--config", "gemma-9", "-o", str(tmp_path / "out")])
    assert res.exit_code == 1
    assert len(res.output.strip().splitlines()) == 1 and "not a shipped config" in res.output


@pytest.mark.parametrize("verdict, same, kind", [
    ("same (per layer type: full_attention, sliding_attention)", True, "same"),
    ("differs: full_attention: frequencies differ by up to 7 relative", False, "differs"),
    ("refused: vLLM: YaRN's cos/sin cache holds 8192 positions", False, "cannot express"),
    ("differs: vLLM refuses it: User-specified max_model_len (131072) is greater than the derived", False,
     "cannot express"),
    ("differs: vLLM refuses it: Model architectures ['Qwen3_5ForCausalLM'] failed to be inspected", False,
     "not run here"),
    ("differs: SGLang: rope type 'proportional' is not re-implemented here", False, "not run here"),
])
def test_a_verdict_becomes_a_cell_kind(verdict, same, kind):
    from eval.conformance import cell_of
    from eval.parity import ParityRow

    row = ParityRow("vllm", "native", 1024, "src", verdict, same=same, exported_by=AS_SHIPPED)
    assert cell_of("x", row).kind == kind


@pytest.mark.parametrize("strategy", ["native", "yarn:factor=2"])
@pytest.mark.parametrize("engine", ["vllm", "llama.cpp"])
@pytest.mark.parametrize("name", sorted(NAMED))
def test_every_family_is_exported_with_ropescales_rotation_or_refused_in_one_line(name, engine, strategy, tmp_path):
    """The issue's families on vLLM and llama.cpp, no engine installed: an export whose rotation (per layer
    type: frequencies, magnitude, softmax factor, query temperature where the engine's is read), by the engine's
    re-implementation, is ropescale's — or one line naming the engine and what it lacks."""
    from ropescale.runs.config import parse_strategy
    from ropescale.serving import ExportRefused, get_engine
    from ropescale.serving.rope import compare, compare_layers, ropescale_layer_ropes, ropescale_rope

    entry = load_shipped(name)
    model, _ = ropescale.load_model(str(build_tiny(entry, tmp_path / name)), device="cpu")
    spec = parse_strategy(strategy)
    length = 2048
    try:
        handle = ropescale.patch(model, spec.name, **spec.resolve(length=length, train_length=4096))
    except InvalidInput as e:  # a model ropescale patches per layer in ways this strategy cannot
        assert "\n" not in str(e)
        return
    with handle:
        eng = get_engine(engine)
        try:
            translation = eng.translate(handle, length)
        except ExportRefused as e:
            assert str(e).startswith(eng.label + ":") and "\n" not in str(e)
            return
        theirs = eng.rope(translation, length, handle.context)
        if isinstance(theirs, dict):
            verdict = compare_layers(ropescale_layer_ropes(handle, length), theirs, length)
        else:
            verdict = compare(ropescale_rope(handle, length), theirs, length)
    assert verdict.same, f"{name} {strategy} {engine}: {verdict.verdict}"


def _own_config(folder, name="mine", file="mine.json", config=None, **top):
    """A config of one's own (SmolLM3's, 256 tokens long) as a JSON file in ``folder``; ``config``: its
    config.json keys replaced; ``top``: its top-level keys replaced (``name=None``: no name)."""
    smol = load_shipped("smollm3-3b")
    raw = {"name": name, "hub": smol.hub, "what": smol.what, "tiny": smol.tiny,
           "config": smol.config | {"max_position_embeddings": 256} | (config or {})} | top
    raw = {k: v for k, v in raw.items() if v is not None}
    path = folder / file
    path.write_text(json.dumps(raw))
    return path


def _files(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


@pytest.mark.parametrize("name", ["../../victim", "..", ".", "a/b", "/tmp/x", "a\\b", "", "x" * 101, 7,
                                  "models", "Conformance.md"])
def test_a_config_name_that_is_not_a_plain_file_name_is_refused_in_one_line(name, tmp_path):
    path = _own_config(tmp_path, name=name)
    with pytest.raises(InvalidInput, match="name") as e:
        load_shipped(str(path))
    assert str(e.value).startswith(f"--config {path}: name ") and "\n" not in str(e.value)


def test_cli_a_config_named_like_a_path_writes_nothing_outside_the_output(tmp_path):
    """Issue 52: ``"name": "../../victim"`` wrote its tiny model and parity files beside ``-o``'s parent,
    over an existing parity.md."""
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    (tmp_path / "a" / "victim").mkdir()
    (tmp_path / "a" / "victim" / "parity.md").write_text("mine")
    path = _own_config(work, name="../../victim")
    before = _files(tmp_path)
    res = CliRunner().invoke(main, ["conformance", "--config", str(path), "--engines", "transformers", "--length", "64",
                                    "-o", str(work / "out")])
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1
    assert "name '../../victim' is not a plain file name" in res.output
    assert _files(tmp_path) == before and (tmp_path / "a" / "victim" / "parity.md").read_text() == "mine"


def test_a_link_out_of_the_output_folder_is_refused_before_anything_is_written(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "models").symlink_to(elsewhere)
    with pytest.raises(OutputError, match="models/mine leads out of it") as e:
        run_conformance([str(_own_config(tmp_path))], engines=["transformers"], output=out, length=64)
    assert "\n" not in str(e.value)
    assert _files(elsewhere) == [] and _files(out) == ["models"]


@pytest.mark.parametrize("second", ["mine", "MINE"])
def test_cli_two_configs_of_one_name_are_refused_up_front(second, tmp_path):
    """Issue 52: two configs named alike overwrote each other's folders and both rows read the first."""
    one = _own_config(tmp_path, name="mine", file="one.json")
    two = _own_config(tmp_path, name=second, file="two.json", config={"rope_theta": 10000.0})
    res = CliRunner().invoke(main, ["conformance", "--config", str(one), "--config", str(two), "--engines",
                                    "transformers", "--length", "64", "-o", str(tmp_path / "out")])
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1
    assert f"--config {two}: the name {second!r} is already that of --config {one}" in res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--length", "0"], "Error: --length: 0 is not a whole number of tokens >= 2 and <= 16777216"),
    (["--length", "-5"], "Error: --length: -5 is not a whole number of tokens >= 2 and <= 16777216"),
    (["--length", "1"], "Error: --length: 1 is not a whole number of tokens >= 2 and <= 16777216"),
    (["--length", str(2**24 + 1)], "Error: --length: 16777217 is not a whole number of tokens >= 2 and <= 16777216"),
    (["--engines", "bogus"], "Error: --engines bogus: choose from llama.cpp, mlx, sglang, transformers, vllm"),
    (["--engines", ""], "Error: --engines (none): choose from llama.cpp, mlx, sglang, transformers, vllm"),
    (["--engines", " , "], "Error: --engines (none): choose from llama.cpp, mlx, sglang, transformers, vllm"),
])
def test_cli_bad_length_or_engines_are_one_line_before_anything_is_written(args, message, tmp_path):
    """Issue 52: --length 0 was replaced by the config's length; -5 and unknown or no engines were refused only
    after the tiny model was written."""
    res = CliRunner().invoke(main, ["conformance", "--config", str(_own_config(tmp_path)), "--engines", "transformers",
                                    "--length", "64", *args, "-o", str(tmp_path / "out")])
    assert res.exit_code == 1 and res.output.strip() == message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("keys", "where", "value"), [
    ({"config": {"max_position_embeddings": "4096"}}, "config.max_position_embeddings", "'4096' (a string)"),
    ({"config": {"max_position_embeddings": "abc"}}, "config.max_position_embeddings", "'abc' (a string)"),
    ({"config": {"max_position_embeddings": 0}}, "config.max_position_embeddings", "0"),
    ({"config": {"max_position_embeddings": 4096.0}}, "config.max_position_embeddings", "4096.0 (a float)"),
    ({"tiny": {"max_position_embeddings": "64"}}, "tiny.max_position_embeddings", "'64' (a string)"),
    ({"length": "512"}, "length", "'512' (a string)"),
    ({"length": True}, "length", "True (a bool)"),
    ({"length": 0}, "length", "0"),
])
def test_cli_a_length_in_a_config_file_that_is_not_a_whole_number_is_one_line_naming_file_and_key(keys, where,
                                                                                                  value, tmp_path):
    """Issue 52: a string max_position_embeddings gave a traceback ("abc") or was refused after the model was
    written ("4096")."""
    path = _own_config(tmp_path, config=keys.pop("config", None), **keys)
    res = CliRunner().invoke(main, ["conformance", "--config", str(path), "--engines", "transformers",
                                    "-o", str(tmp_path / "out")])
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1
    assert res.output.startswith(f"Error: --config {path}: {where}: {value} is not a whole number of tokens >= 2")
    assert not (tmp_path / "out").exists()


def test_llama_cpps_as_shipped_cell_says_why_it_is_not_run_here(tmp_path, monkeypatch):
    """Issue 52: without llama.cpp (its converter reads a config as shipped) the cell was blank ("—")."""
    monkeypatch.setenv("ROPESCALE_LLAMA_CPP_PYTHON", str(tmp_path / "no-such-python"))
    cells, meta = run_conformance([str(_own_config(tmp_path))], engines=["transformers", "llama.cpp"],
                                  output=tmp_path / "out", length=64)
    shipped = {c.engine: c for c in cells if c.exported_by == AS_SHIPPED}
    assert shipped["transformers"].kind == "same"
    assert shipped["llama.cpp"].kind == "not run here"
    assert "converter (convert_hf_to_gguf.py)" in shipped["llama.cpp"].text
    assert "not installed" in shipped["llama.cpp"].text
    as_shipped_table = markdown(cells, meta).split("given the config.json as shipped")[1].split("ropescale's export")[0]
    assert "| same | **not run here**: llama.cpp: reads the config as shipped with its converter" in as_shipped_table
    assert "—" not in as_shipped_table
    written = json.loads((tmp_path / "out" / "conformance.json").read_text())
    assert {(c["engine"], c["kind"]) for c in written["cells"] if c["exported_by"] == AS_SHIPPED} == {
        ("transformers", "same"), ("llama.cpp", "not run here")}


def test_llama_cpp_installed_without_its_converter_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("ROPESCALE_LLAMA_CPP_PYTHON", sys.executable)
    monkeypatch.setenv("ROPESCALE_LLAMA_CPP_SOURCE", str(tmp_path / "no-source"))
    with pytest.raises(InvalidInput, match="convert_hf_to_gguf.py") as e:
        run_conformance([str(_own_config(tmp_path))], engines=["transformers", "llama.cpp"], output=tmp_path / "out",
                        length=64)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
