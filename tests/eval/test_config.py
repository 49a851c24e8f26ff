import pytest

from eval.config import ConfigError, build_config, load_config, parse_strategy


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_full_config_and_defaults(tmp_path):
    cfg = load_config(write(tmp_path, """
model: reference
data: {source: kjv-heldout, max_documents: 3}
lengths: [512, 128, 256, 128]
strategies:
  - vanilla
  - yarn:beta_fast=16
  - {name: linear, factor: 2, label: pi-2x}
"""))
    assert cfg.lengths == [128, 256, 512] and cfg.options.mode == "chunk" and cfg.data.max_documents == 3
    assert cfg.task == "perplexity"
    assert [s.display for s in cfg.strategies] == ["vanilla", "yarn:beta_fast=16", "pi-2x"]
    assert cfg.strategies[2].params == {"factor": 2}


def test_overrides_with_dots(tmp_path):
    p = write(tmp_path, "lengths: [128]\nstrategies: [vanilla]\ndata: kjv-heldout\n")
    cfg = load_config(p, ["lengths=[64, 32]", "data.max_documents=2", "mode=sliding", "stride=16"])
    assert cfg.lengths == [32, 64] and cfg.data.source == "kjv-heldout" and cfg.data.max_documents == 2
    assert cfg.options.mode == "sliding" and cfg.options.stride == 16


@pytest.mark.parametrize("text,match", [
    ("lengths: [128\n", r"c.yaml: not valid YAML"),
    ("- just a list\n", r"expected a mapping"),
    ("lenghts: [128]\nstrategies: [vanilla]\n", r"lenghts: unknown key.*did you mean 'lengths'"),
    ("lengths: [128]\nstrategies: [yarnn]\n",
     r"strategies: entry 0 \('yarnn'\): unknown strategy.*did you mean 'yarn'"),
    ("lengths: [128]\nstrategies: ['yarn:factor=0.5']\n",
     r"strategies: entry 0.*factor=0.5 is out of range; allowed: >= 1"),
    ("lengths: [128]\nstrategies: [{factor: 2}]\n", r"strategies: entry 0.*has no 'name'"),
    ("lengths: []\nstrategies: [vanilla]\n", r"lengths: List should have at least 1 item"),
    ("lengths: [1]\nstrategies: [vanilla]\n", r"lengths: .*at least 2 tokens"),
    ("lengths: [128]\nstrategies: [vanilla]\nmode: window\n", r"mode: Input should be 'chunk' or 'sliding'"),
    ("lengths: [128]\nstrategies: [vanilla]\ndata: {sorce: x}\n", r"data.sorce: unknown key.*did you mean 'source'"),
    ("lengths: [64]\nstrategies: [vanilla]\nmode: sliding\nstride: 100\n", r"stride 100 is longer"),
    ("strategies: [vanilla]\n", r"lengths: required key is missing"),
])
def test_malformed_configs_name_the_key(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, text))


def test_missing_file_and_bad_override(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(write(tmp_path, "lengths: [128]\nstrategies: [vanilla]\n"), ["lengths"])


def test_strategy_string_parsing():
    s = parse_strategy("yarn:factor=4,beta_fast=16.5")
    assert s.name == "yarn" and s.params == {"factor": 4, "beta_fast": 16.5}
    with pytest.raises(ValueError, match="key=value"):
        parse_strategy("yarn:factor")
    assert build_config({"lengths": [8], "strategies": ["ntk"]}).strategies[0].params == {}


def test_logn_is_an_option_not_a_strategy_parameter():
    s = parse_strategy("yarn:beta_fast=16,logn=true")
    assert s.logn and s.params == {"beta_fast": 16} and s.display == "yarn:beta_fast=16+logn"
    m = parse_strategy({"name": "ntk", "logn": True})
    assert m.logn and m.params == {} and m.display == "ntk+logn"


def test_yaml_merge_keys_are_read(tmp_path):
    from eval.config import read_yaml

    raw = read_yaml(write(tmp_path, "base: &b {source: kjv-heldout, max_documents: 3}\n"
                                    "data:\n  <<: *b\n  max_documents: 2\n"))
    assert raw["data"] == {"source": "kjv-heldout", "max_documents": 2}
    with pytest.raises(ConfigError, match="key 'max_documents' is given twice"):
        read_yaml(write(tmp_path, "base: &b {a: 1}\ndata:\n  <<: *b\n  max_documents: 2\n  max_documents: 3\n"))


def test_a_task_given_as_a_list_names_the_known_tasks(tmp_path):
    with pytest.raises(ConfigError, match=r"task: .*\['passkey'\].*known tasks: .*passkey"):
        load_config(write(tmp_path, "task: [passkey]\nlengths: [128]\nstrategies: [vanilla]\n"))


@pytest.mark.parametrize("task,options,match", [
    ("passkey", "{trials: true}", r"passkey.trials: expected an integer, got true"),
    ("needle", "{trials: false}", r"needle.trials: expected an integer, got false"),
    ("needle", "{digits: true}", r"needle.digits: expected an integer, got true"),
    ("passkey", "{depths: [0.5, true]}", r"passkey.depths: expected numbers, got true"),
    ("perplexity", "{batch_size: true}", r"perplexity.batch_size: expected an integer, got true"),
    ("perplexity", "{max_windows: true}", r"perplexity.max_windows: expected an integer, got true"),
])
def test_integer_options_refuse_booleans(tmp_path, task, options, match):
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, f"task: {task}\n{task}: {options}\nlengths: [128]\nstrategies: [vanilla]\n"))
    assert load_config(write(tmp_path, f"task: {task}\nlengths: [128]\nstrategies: [vanilla]\n")).task == task


def test_a_utf8_config_reads_under_an_ascii_locale(tmp_path):
    """YAML is UTF-8: a non-ASCII label reads the same whatever the machine's locale."""
    import os
    import subprocess
    import sys

    p = tmp_path / "c.yaml"
    p.write_text("lengths: [128]\nstrategies: [{name: linear, factor: 2, label: 'π-ß-線形'}]\n", encoding="utf-8")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    code = f"from eval.config import load_config; print(ascii(load_config({str(p)!r}).strategies[0].display))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=os.getcwd())
    assert out.returncode == 0 and out.stdout.strip() == ascii("π-ß-線形"), out.stderr[-2000:]


@pytest.mark.parametrize("entry,message", [
    ("{name: dca, chunk_size: .inf}", "dca: parameter chunk_size=inf must be a finite whole number; allowed: >= 2"),
    ("{name: dca, params: {local_window: .NaN}}", "dca: parameter local_window=nan must be a finite whole number; "
                                                  "allowed: >= 0"),
    ("'dca:chunk_size=-.inf'", "dca: parameter chunk_size=-inf must be a finite whole number; allowed: >= 2"),
    ("'yarn:factor=.nan'", "yarn: parameter factor=nan must be a finite number; allowed: >= 1"),
    ("{name: dca, chunk_size: 16, local_window: 16}",
     "dca: local_window=16 must be below chunk_size=16 (both in tokens)"),
])
def test_non_finite_and_contradicting_parameters_in_yaml_are_one_line(tmp_path, entry, message):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, f"model: reference\nlengths: [128]\nstrategies:\n  - vanilla\n  - {entry}\n"))
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{tmp_path / 'c.yaml'}: strategies: entry 1 (")
    assert str(e.value).endswith(message)
