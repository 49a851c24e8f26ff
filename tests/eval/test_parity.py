"""`ropescale parity` and the engine runner, without the engines: the arithmetic against hand-made
numbers, the table logic against fake engine drivers (a known non-parity is never "same"), and the
one-line errors for absent or failing engines. The real engines: tests/eval/test_real_engines.py."""

import json
import math
import os
import stat
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli import main
from eval import engines
from eval.parity import ParityRow, angle_table_diff, e2e_numbers, markdown, run_parity, write_parity
from ropescale.errors import RopescaleError
from ropescale.runs.config import parse_strategy


@pytest.fixture
def no_engines(monkeypatch, tmp_path):
    """Both engines absent, whatever this machine has installed."""
    monkeypatch.setenv("ROPESCALE_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    monkeypatch.setenv("ROPESCALE_LLAMA_CPP_PYTHON", str(tmp_path / "no-such-python"))


def _fake_engine(tmp_path, monkeypatch, result: dict | None, exit_code: int = 0, engine="vllm", raw=None):
    """An 'engine python' that ignores the driver and writes ``result`` (or the text ``raw``; or fails)."""
    out = tmp_path / f"fake-{engine}-result.json"
    out.write_text(json.dumps(result or {}) if raw is None else raw)
    script = tmp_path / f"fake-{engine}-python"
    body = (f'cp "{out}" "$3"\n' if exit_code == 0 else
            f'echo "RuntimeError: the engine fell over" >&2\nexit {exit_code}\n')
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv(engines.environment(engine).variable, str(script))
    return script


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def _table(inv_freq: torch.Tensor, n: int, magnitude: float = 1.0):
    m = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq.double()[None]
    return (magnitude * torch.cos(m)).tolist(), (magnitude * torch.sin(m)).tolist()


# --- arithmetic, against hand-computed values ---------------------------------------------------

def test_angle_table_diff_measures_the_wrapped_rotation_difference():
    theta = torch.tensor([1.0, 0.1, 0.001], dtype=torch.float64)
    cos, sin = _table(theta, 50, magnitude=1.3)  # the magnitude does not change an angle
    assert angle_table_diff(_t(cos), _t(sin), theta) < 1e-12
    # the slowest pair 1% fast: 0.00001 rad per token, 49 tokens
    cos, sin = _table(theta * torch.tensor([1.0, 1.0, 1.01]), 50)
    assert angle_table_diff(_t(cos), _t(sin), theta) == pytest.approx(49e-5, rel=1e-6)
    # a difference of π/4 per token reaches π at position 4: the wrapped difference never exceeds π
    cos, sin = _table(torch.tensor([1.0 + math.pi / 4]), 5)
    assert angle_table_diff(_t(cos), _t(sin), torch.tensor([1.0])) == pytest.approx(math.pi)
    bad = _t(cos)
    bad[3, 0] = math.nan
    assert angle_table_diff(bad, _t(sin), torch.tensor([1.0])) == math.inf


def test_e2e_numbers_max_difference_perplexities_and_nan():
    ours = [[-1.0, -2.0], [-3.0]]
    same = e2e_numbers(ours, [[-1.0, -2.0], [-3.0]])
    assert same == {"max_abs_dlogp": 0.0, "mean_abs_dlogp": 0.0, "ppl_ropescale": pytest.approx(math.exp(2.0)),
                    "ppl_engine": pytest.approx(math.exp(2.0)), "nan_positions": 0, "tokens": 3}
    off = e2e_numbers(ours, [[-1.0, -2.5], [-2.9]])
    assert off["max_abs_dlogp"] == pytest.approx(0.5) and off["ppl_engine"] == pytest.approx(math.exp(6.4 / 3))
    assert off["mean_abs_dlogp"] == pytest.approx((0.0 + 0.5 + 0.1) / 3)
    nan = e2e_numbers(ours, [[-1.0, math.nan], [-3.0]])
    assert nan["nan_positions"] == 1 and nan["max_abs_dlogp"] == math.inf and math.isnan(nan["ppl_engine"])
    with pytest.raises(RopescaleError, match="log-prob counts differ"):
        e2e_numbers(ours, [[-1.0]])


# --- the engine runner ---------------------------------------------------------------------------

def test_absent_engine_is_one_line_naming_the_variable_and_the_install_script(no_engines):
    assert engines.engine_python("vllm") is None
    line = engines.engine_status("llama.cpp")
    assert "llama.cpp is not installed" in line and "ROPESCALE_LLAMA_CPP_PYTHON" in line
    assert "bench/engines/install.sh" in line and "\n" not in line
    with pytest.raises(engines.EngineAbsent, match="vLLM is not installed"):
        engines.run_engine("vllm", {"mode": "rope", "cases": []})
    with pytest.raises(engines.EngineAbsent, match="unknown engine 'tgi'"):
        engines.engine_python("tgi")


def test_run_engine_reads_the_driver_result_and_a_failing_driver_is_one_line(tmp_path, monkeypatch):
    _fake_engine(tmp_path, monkeypatch, {"cases": [], "vllm": "fake"})
    got = engines.run_engine("vllm", {"mode": "rope", "cases": []})
    assert got["vllm"] == "fake" and got["seconds"] >= 0
    _fake_engine(tmp_path, monkeypatch, None, exit_code=3)
    with pytest.raises(engines.EngineFailed) as e:
        engines.run_engine("vllm", {"mode": "rope", "cases": []}, log_dir=tmp_path / "logs")
    msg = str(e.value)
    assert "exit 3" in msg and "RuntimeError: the engine fell over" in msg and "\n" not in msg
    assert (tmp_path / "logs" / "vllm-rope.log").is_file()


def test_the_scripts_are_package_data_that_never_import_ropescale():
    """The scripts run in the engines' own environments (other torch/transformers): standalone, in each engine
    package's ``scripts/`` folder — no package, so no registry imports them — and installed as package data."""
    import ast

    import tomllib

    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-data"]
    envs = engines.registry.environments()
    assert {"vllm", "llama.cpp", "mlx"} <= set(envs)
    seen = set()
    for name, env in envs.items():
        assert (env.scripts / env.script).is_file(), name
        assert not (env.scripts / "__init__.py").exists(), name
        package = "ropescale_eval." + ".".join(env.scripts.parent.relative_to(root / "eval").parts)
        assert data.get(package) == ["scripts/*.py"], (name, package)
        for path in env.scripts.glob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            mods |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            assert not mods & {"ropescale", "eval", "ropescale_eval", "cli", "transformers"}, (path.name, mods)
            seen.add(path.name)
    assert {"vllm_driver.py", "llama_cpp_driver.py", "convert_gguf.py", "mlx_driver.py"} <= seen


# --- the parity table against fake engines (known non-parities) ----------------------------------

def _run(tiny_model_dir, tmp_path, strategy, length=64, engine_list=("vllm",), **kw):
    rows, meta = run_parity(str(tiny_model_dir), [parse_strategy(strategy)], [length], engines=list(engine_list),
                            output=tmp_path / "out", **kw)
    return rows, meta


def test_without_engines_the_rows_come_from_the_reimplementations_and_say_so(tiny_model_dir, tmp_path, no_engines):
    rows, meta = _run(tiny_model_dir, tmp_path, "yarn", engine_list=("vllm", "llama.cpp"))
    assert [(r.engine, r.verdict) for r in rows] == [("vllm", "same"), ("llama.cpp", "same")]
    assert "re-implementation" in rows[0].source and "vllm_rope" in rows[0].source
    assert "llama_cpp_rope" in rows[1].source
    assert all("not installed" in e for e in meta["engines"])
    # YaRN's magnitude 0.1·ln 2 + 1 at L = 2T, both sides
    assert rows[0].magnitude_ropescale == pytest.approx(0.1 * math.log(2) + 1) == rows[0].magnitude_engine


def test_refusals_are_rows_with_the_reason_never_same(tiny_model_dir, tmp_path, no_engines):
    rows, _ = _run(tiny_model_dir, tmp_path, "yarn:beta_fast=16,beta_slow=2", engine_list=("vllm", "llama.cpp"))
    assert rows[0].verdict == "same"  # vLLM reads the betas
    assert rows[1].verdict.startswith("refused: llama.cpp:") and "yarn_beta" in rows[1].verdict
    assert rows[1].same is False
    rows, _ = _run(tiny_model_dir, tmp_path, "rerope", engine_list=("vllm", "llama.cpp"))
    assert all(r.verdict.startswith("refused:") and r.same is False for r in rows)
    rows, _ = _run(tiny_model_dir, tmp_path, "dynamic_ntk", engine_list=("llama.cpp",), freeze_dynamic=False)
    assert rows[0].verdict.startswith("refused: llama.cpp:")


def test_baseline_rows_show_what_save_patched_served_before(tiny_model_dir, tmp_path, no_engines):
    """save_patched's config.json as vLLM's config (max_position_embeddings left at T): vLLM refuses
    serving 2T of dynamic NTK; ropescale's export of the same patch is the same. The llama.cpp
    baseline needs llama.cpp's converter, so without it there is no such row."""
    rows, meta = _run(tiny_model_dir, tmp_path, "dynamic_ntk", engine_list=("transformers", "vllm", "llama.cpp"),
                      baseline=True)
    assert [(r.engine, r.exported_by) for r in rows] == [
        ("transformers", "ropescale"), ("vllm", "ropescale"), ("llama.cpp", "ropescale"),
        ("vllm", "save_patched config.json as written")]
    rows = rows[1:]
    assert rows[0].verdict == rows[1].verdict == "same"
    assert rows[2].same is False and rows[2].verdict.startswith("differs: vLLM refuses max_model_len 64 > 32")
    assert meta["baseline"] is True
    md = markdown(rows, meta)
    assert "| exported by |" in md and "| vllm | save_patched config.json as written | `dynamic_ntk` |" in md


def _vllm_table_result(theta: torch.Tensor, n: int, magnitude: float = 1.0, cache: int | None = None):
    cos, sin = _table(theta, n, magnitude)
    return {"vllm": "fake", "cases": [{"class": "FakeRotaryEmbedding", "cache_length": cache or n,
                                       "evaluated": n, "max_position": cache or n, "cos": cos, "sin": sin}]}


def test_an_engine_rotating_as_ropescale_is_same_from_its_own_table(tiny_model_dir, tmp_path, monkeypatch):
    from ropescale.strategies.frequency import rope_inv_freq

    theta = rope_inv_freq(16, 10000.0).double() / 2  # linear, s = 2 at L = 2T: θ_i / 2, computed here
    _fake_engine(tmp_path, monkeypatch, _vllm_table_result(theta, 64))
    rows, _ = _run(tiny_model_dir, tmp_path, "linear")
    assert rows[0].verdict == "same", rows[0].verdict
    assert rows[0].source.startswith("vLLM fake ModelConfig + get_rope (FakeRotaryEmbedding")
    assert rows[0].max_angle_diff < 1e-5


def test_known_non_parities_from_the_engine_table_are_never_same(tiny_model_dir, tmp_path, monkeypatch):
    from ropescale.strategies.frequency import rope_inv_freq

    d, s = 16, 2.0
    vllm_ntk = 1.0 / ((10000.0 * s) ** (torch.arange(0, d, 2).double() / d)) / s ** (2 / d)  # vLLM's own "ntk"
    _fake_engine(tmp_path, monkeypatch, _vllm_table_result(vllm_ntk, 64))
    row = _run(tiny_model_dir, tmp_path, "ntk")[0][0]
    assert row.same is False and row.verdict.startswith("differs: frequencies differ") and "pair 0" in row.verdict
    assert row.max_angle_diff > 1e-2
    # the right frequencies with YaRN's magnitude missing
    theta = rope_inv_freq(d, 10000.0).double() / s
    _fake_engine(tmp_path, monkeypatch, _vllm_table_result(theta, 64, magnitude=1.0))
    row = _run(tiny_model_dir, tmp_path, "yarn:beta_fast=1000,beta_slow=999")[0][0]
    assert row.same is False and "magnitude" in row.verdict
    # the cos/sin cache ends before L (vLLM returns NaN past it)
    _fake_engine(tmp_path, monkeypatch, _vllm_table_result(theta, 32, cache=32))
    row = _run(tiny_model_dir, tmp_path, "linear")[0][0]
    assert row.same is False and "cache holds 32 positions" in row.verdict and row.max_angle_diff == math.inf
    # vLLM refusing the config
    _fake_engine(tmp_path, monkeypatch, {"vllm": "fake", "cases": [{"error": "ValueError: max_model_len too long"}]})
    row = _run(tiny_model_dir, tmp_path, "linear")[0][0]
    assert row.same is False and "vLLM refuses it: ValueError" in row.verdict


def test_end_to_end_with_a_fake_engine_reports_its_nan_positions(tiny_model_dir, tmp_path, monkeypatch, text_file):
    from ropescale.strategies.frequency import rope_inv_freq

    theta = rope_inv_freq(16, 10000.0).double() / 2
    rope = _vllm_table_result(theta, 64)
    # one fake serves both modes: rope cases and log-probs (NaN from position 40 on, as vLLM past its cache)
    rope["jobs"] = [{"logprobs": [[-1.0] * 40 + [math.nan] * 23], "seconds": 0.1}]
    _fake_engine(tmp_path, monkeypatch, rope)
    rows, meta = _run(tiny_model_dir, tmp_path, "linear", end_to_end=True, data=str(text_file))
    r = rows[0]
    assert r.tokens == 63 and r.nan_positions == 23 and r.max_abs_dlogp == math.inf
    paths = write_parity(rows, tmp_path / "out", meta)
    md = paths["markdown"].read_text()
    assert "∞ (23 NaN)" in md and f"model `{tiny_model_dir}`" in md and "end to end on" in md
    header = paths["csv"].read_text().splitlines()[0].split(",")
    assert {"model", "data", "windows", "train_length", "max_abs_dlogp", "verdict"} <= set(header)
    assert paths["plot"].stat().st_size > 1000


def test_gemma3_rows_compare_every_layer_type_without_the_engines(tiny_gemma3_dir, tmp_path, no_engines):
    """Gemma 3 (main: every engine refused, "per-layer-type rotary patches ... are not exported"; the
    transformers row failed to find a rotary module with ``inv_freq``): the sliding layers at their own
    base unscaled, the global ones scaled, in every engine."""
    rows, _ = run_parity(str(tiny_gemma3_dir), [parse_strategy(s) for s in ("yarn:factor=4", "linear:factor=4")],
                         [256], engines=["transformers", "vllm", "llama.cpp"], output=tmp_path / "o")
    assert [(r.engine, r.strategy, r.verdict) for r in rows] == [
        (e, s, "same (per layer type: full_attention, sliding_attention)")
        for s in ("yarn:factor=4", "linear:factor=4") for e in ("transformers", "vllm", "llama.cpp")]
    assert "re-implementation" in rows[1].source and "llama_cpp_rope" in rows[2].source
    assert rows[0].magnitude_ropescale == pytest.approx(0.1 * math.log(4) + 1) == rows[1].magnitude_engine


def test_a_vllm_answering_per_layer_type_is_compared_type_by_type(tiny_gemma3_dir, tmp_path, monkeypatch):
    from ropescale.strategies.frequency import rope_inv_freq

    local, full = rope_inv_freq(16, 10000.0).double(), rope_inv_freq(16, 1e6).double() / 4  # linear ×4, global only

    def tables(sliding, full_attention):  # asked in the exported config's order (saved sorted: full, sliding)
        return {"vllm": "fake", "cases": [_vllm_table_result(t, 256)["cases"][0] for t in (full_attention, sliding)]}

    def row():
        return run_parity(str(tiny_gemma3_dir), [parse_strategy("linear:factor=4")], [256], engines=["vllm"],
                          output=tmp_path / "o")[0][0]

    _fake_engine(tmp_path, monkeypatch, tables(local, full))
    r = row()
    assert r.verdict == "same (per layer type: full_attention, sliding_attention)", r.verdict
    assert r.source.startswith("vLLM fake ModelConfig + get_rope (FakeRotaryEmbedding")
    _fake_engine(tmp_path, monkeypatch, tables(local / 4, full))  # the sliding layers scaled too
    r = row()
    assert r.same is False and r.verdict.startswith("differs: sliding_attention: frequencies differ"), r.verdict
    assert "full_attention" not in r.verdict and r.max_angle_diff > 1e-2


def test_plain_transformers_rows_load_the_export_without_ropescale(tiny_model_dir, tmp_path, text_file):
    rows, _ = run_parity(str(tiny_model_dir), [parse_strategy(s) for s in ("dynamic_ntk", "yarn", "rerope")], [64],
                         engines=["transformers"], end_to_end=True, data=str(text_file), output=tmp_path / "o")
    dyn, yarn, rerope = rows
    assert dyn.verdict == yarn.verdict == "same" and dyn.source.startswith("transformers 5.")
    assert yarn.magnitude_engine == pytest.approx(0.1 * math.log(2) + 1)
    assert dyn.max_abs_dlogp < 1e-4 and yarn.max_abs_dlogp < 1e-4 and dyn.tokens == 63
    assert rerope.verdict.startswith("refused: transformers: rerope") and rerope.same is False


def test_markdown_names_model_and_settings_and_escapes_pipes():
    row = ParityRow("vllm", "yarn", 512, "src", "differs: a | b", same=False, max_rel_freq_diff=0.5)
    md = markdown([row], {"model": "m", "train_length": 128, "dim": 32, "lengths": [512], "engines": ["vLLM x"],
                          "data": "kjv-heldout", "windows": 1})
    assert md.startswith("Parity — model `m` (T = 128, d = 32), lengths 512, engines: vLLM x")
    assert "differs: a \\| b" in md


# --- the CLI -------------------------------------------------------------------------------------

def test_cli_end_to_end_without_the_engine_is_one_line(tiny_model_dir, tmp_path, no_engines):
    res = CliRunner().invoke(main, ["parity", "--model", str(tiny_model_dir), "--strategy", "linear", "--lengths", "64",
                                    "--engines", "vllm", "--end-to-end", "-o", str(tmp_path / "o")])
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: vLLM is not installed") and "install.sh" in lines[0]


def test_cli_unknown_engine_is_one_line(tiny_model_dir, tmp_path, no_engines):
    res = CliRunner().invoke(main, ["parity", "--model", str(tiny_model_dir), "--strategy", "linear", "--lengths", "64",
                                    "--engines", "tgi", "-o", str(tmp_path / "o")])
    assert res.exit_code == 1
    assert res.output.strip() == "Error: --engines tgi: choose from llama.cpp, mlx, sglang, transformers, vllm"


def test_cli_takes_the_old_engine_name_gguf_with_one_note(tiny_model_dir, tmp_path, no_engines):
    res = CliRunner().invoke(main, ["parity", "--model", str(tiny_model_dir), "--strategy", "linear", "--lengths", "64",
                                    "--engines", "gguf", "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert res.output.count("Warning: engine 'gguf' is deprecated; use 'llama.cpp'") == 1
    assert "FutureWarning" not in res.output
    assert "llama.cpp linear" in res.output and "same" in res.output


def test_cli_without_engines_writes_the_reports(tiny_model_dir, tmp_path, no_engines):
    res = CliRunner().invoke(main, ["parity", "--model", str(tiny_model_dir), "--strategy", "yarn", "--strategy",
                                    "self_extend", "--lengths", "64", "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "vllm      yarn" in res.output and "refused: vLLM: self_extend" in res.output
    assert sorted(p.name for p in (tmp_path / "o").glob("parity.*")) == \
        ["parity.csv", "parity.json", "parity.md", "parity.png"]


def test_the_engine_python_is_found_by_variable_then_prefix(tmp_path, monkeypatch):
    fake = tmp_path / "root" / "llama" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text("")
    monkeypatch.delenv("ROPESCALE_LLAMA_CPP_PYTHON", raising=False)
    monkeypatch.setenv("ROPESCALE_ENGINES", str(tmp_path / "root"))
    assert engines.engine_python("llama.cpp") == fake
    monkeypatch.setenv("ROPESCALE_LLAMA_CPP_PYTHON", sys.executable)
    assert engines.engine_python("llama.cpp") == type(fake)(sys.executable)
    assert os.path.isfile(engines.engine_python("llama.cpp"))


@pytest.mark.parametrize(("args", "message"), [
    (["--lengths", "1"], "Error: --lengths 1: lengths must be whole numbers of tokens >= 2"),
    (["--lengths", "64", "--windows", "0"], "Error: --windows 0: must be a whole number >= 1"),
    (["--lengths", "64", "--gguf", "missing.gguf"], "Error: --gguf missing.gguf: no such GGUF file"),
])
def test_cli_bad_length_windows_or_gguf_is_one_line_exit_1(tiny_model_dir, tmp_path, no_engines, args, message):
    res = CliRunner().invoke(main, ["parity", "--model", str(tiny_model_dir), "--strategy", "linear", *args,
                                    "-o", str(tmp_path / "o")])
    assert res.exit_code == 1 and res.output.strip() == message
    assert not (tmp_path / "o").exists()


# --- hostile engines and lengths (issue 26): one line, exit 1, no report --------------------------

def test_cli_a_length_past_2_24_is_refused_before_any_work(tiny_model_dir, tmp_path, no_engines):
    res = CliRunner().invoke(main, ["parity", "--model", str(tiny_model_dir), "--strategy", "linear", "--lengths",
                                    str(2 ** 24 + 1), "--engines", "vllm,llama.cpp", "-o", str(tmp_path / "o")])
    assert res.exit_code == 1
    assert res.output.strip() == ("Error: --lengths 16777217: beyond any model: RoPE angles come from float32 "
                                  "positions, exact only up to 2^24 = 16777216 tokens; use lengths of at most 16777216")
    assert not (tmp_path / "o").exists()


def test_cli_a_torn_driver_result_is_one_line_naming_the_driver_and_the_kept_file(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    torn = '{"vllm": "fake", "cases": [{"class": "RotaryEmbedding", "cos": [[1.0, 0.99'
    _fake_engine(tmp_path, monkeypatch, None, raw=torn)
    out = tmp_path / "o"
    res = CliRunner().invoke(main, ["parity", "--model", str(tiny_model_dir), "--strategy", "linear", "--length", "64",
                                    "--engine", "vllm", "-o", str(out)])
    assert res.exit_code == 1, res.output
    kept = out / "logs" / "vllm-rope.result.json"
    with pytest.raises(json.JSONDecodeError) as why:  # what Python's json says of the torn text
        json.loads(torn)
    assert res.output.strip().splitlines()[-1] == (f"Error: vLLM driver vllm_driver.py left an unreadable result "
                                                   f"(JSONDecodeError: {why.value}): {kept} (log: "
                                                   f"{out / 'logs' / 'vllm-rope.log'})")
    assert kept.read_text() == torn and not (out / "parity.md").exists()


def test_run_engine_a_result_that_is_no_json_object_is_one_line(tmp_path, monkeypatch):
    _fake_engine(tmp_path, monkeypatch, None, raw="[1, 2]")
    with pytest.raises(engines.EngineFailed, match="^vLLM driver vllm_driver.py left an unreadable result "
                                                   r"\(a JSON list, not an object\): .*vllm-rope.result.json"):
        engines.run_engine("vllm", {"mode": "rope", "cases": []})


def _gguf_of(model_dir, path):
    from transformers import AutoConfig

    from tests.serving.tiny_gguf import write_tiny_llama_gguf

    return write_tiny_llama_gguf(path, AutoConfig.from_pretrained(model_dir))


@pytest.mark.parametrize(("engine", "answer", "message"), [
    ("vllm", "one", "vLLM driver (vllm_driver.py) answered 1 of the 2 cases asked; no answer for yarn@64"),
    ("vllm", "none", "vLLM driver (vllm_driver.py) answered 0 of the 2 cases asked; no answer for linear@64, yarn@64"),
    ("vllm", "no list", "vLLM driver (vllm_driver.py) answered no 'cases' list; asked for 2: linear@64, yarn@64"),
    ("vllm", "no table", "vLLM driver (vllm_driver.py) answered linear@64 without cos and sin and evaluated: "
                         "{'class': 'RotaryEmbedding'}"),
    ("llama.cpp", "none", "llama.cpp driver (llama_cpp_driver.py) answered 0 of the 2 cases asked; no answer for "
                          "linear@64, yarn@64"),
])
def test_cli_a_driver_answering_fewer_cases_than_asked_is_refused_naming_them(tiny_model_dir, tmp_path, monkeypatch,
                                                                              no_engines, engine, answer, message):
    from ropescale.strategies.frequency import rope_inv_freq

    one = _vllm_table_result(rope_inv_freq(16, 10000.0).double() / 2, 64)["cases"] if engine == "vllm" else \
        [{"meta": {}}]
    cases = {"one": one, "none": [], "no table": [{"class": "RotaryEmbedding"}] * 2}.get(answer)
    _fake_engine(tmp_path, monkeypatch, {engine.replace(".", "_"): "fake", **({} if cases is None else
                                                                              {"cases": cases})}, engine=engine)
    gguf = ["--gguf", str(_gguf_of(tiny_model_dir, tmp_path / "base.gguf"))] if engine == "llama.cpp" else []
    out = tmp_path / "o"
    res = CliRunner().invoke(main, ["parity", "--model", str(tiny_model_dir), "--strategy", "linear", "--strategy",
                                    "yarn", "--length", "64", "--engine", engine, *gguf, "-o", str(out)])
    assert res.exit_code == 1, res.output
    assert res.output.strip().splitlines()[-1] == f"Error: {message}"  # after the "Loading weights" bar
    assert not (out / "parity.md").exists()


def test_end_to_end_answers_missing_say_so_in_every_row(tiny_model_dir, tmp_path, monkeypatch, text_file):
    """A short end-to-end answer is a failed end to end (as a driver that dies): the rotation rows
    stand, each end-to-end cell empty with the reason, never a row silently without numbers."""
    from ropescale.strategies.frequency import rope_inv_freq

    result = _vllm_table_result(rope_inv_freq(16, 10000.0).double() / 2, 64)
    result["jobs"] = []
    _fake_engine(tmp_path, monkeypatch, result)
    rows, _ = _run(tiny_model_dir, tmp_path, "linear", end_to_end=True, data=str(text_file))
    assert rows[0].verdict == "same" and rows[0].max_abs_dlogp is None
    assert rows[0].notes.endswith("end to end failed: vLLM driver (vllm_driver.py) answered 0 of the 1 jobs asked; "
                                  "no answer for linear@64")
