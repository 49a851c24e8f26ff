"""``ropescale patch`` applies the strategy spec's query temperature on every path (issue 52): the dry run's
table, the export for each engine, the request-length profiles. The oracle for the saved folder is transformers'
own Ministral 3 (its YaRN with the shipped β in ``rope_parameters``), not ropescale."""

import json

import pytest
import torch
import transformers as T
from click.testing import CliRunner

import ropescale
from cli import main
from ropescale.models import REFERENCE_MODEL

W = 32  # the tiny Ministral 3's training window T [tokens]
BETA = 0.3  # its shipped query temperature (llama_4_scaling_beta)
IDS = torch.randint(3, 4000, (1, 120), generator=torch.Generator().manual_seed(52))  # past 3T: β scales queries


def _ministral(beta: float, rope: dict, vocab: int, window: int = W):
    rp = {"rope_theta": 10000.0, "original_max_position_embeddings": W, "llama_4_scaling_beta": beta, **rope}
    cfg = T.Ministral3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=window,
                             pad_token_id=None, rope_parameters=rp)
    torch.manual_seed(0)
    return T.Ministral3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ministral_dir(tmp_path_factory):
    """A saved tiny random Ministral 3 (β = 0.3, T = 32, unscaled) with the bundled tokenizer; its LM head × 100,
    so that what β moves stands well above float32 rounding."""
    tok = T.AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    path = tmp_path_factory.mktemp("ministral3")
    model = _ministral(BETA, {"rope_type": "default"}, len(tok))
    with torch.no_grad():
        model.lm_head.weight.mul_(100)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def run():
    runner = CliRunner()
    return lambda *args: runner.invoke(main, [str(a) for a in args])


def _temperatures(output: str) -> list[str]:
    """The dry-run table's temperature column (the text after the ``applied`` column, ``yarn``)."""
    rows = [line for line in output.splitlines() if line[:1].isdigit()]
    return [line.split("  yarn", 1)[1].strip() for line in rows]


def test_dry_run_keeps_the_models_temperature_with_native(run, ministral_dir):
    res = run("patch", "--model", ministral_dir, "--strategy", "yarn:factor=2,temperature=native", "--dry-run", "-q")
    assert res.exit_code == 0, res.output
    assert _temperatures(res.output) == [f"beta:beta={BETA} (model's, kept)"] * 2
    res = run("patch", "--model", ministral_dir, "--strategy", "yarn:factor=2", "--dry-run", "-q")
    assert _temperatures(res.output) == [f"beta:beta={BETA} (model's) removed"] * 2  # the default, as said


def test_dry_run_shows_an_added_temperature(run):
    res = run("patch", "--model", "reference", "--strategy", "yarn:factor=2,temperature=beta:beta=0.5", "--dry-run",
              "-q")
    assert res.exit_code == 0, res.output
    rows = _temperatures(res.output)
    assert len(rows) == 4 and set(rows) == {"beta:beta=0.5 (added)"}


def test_saved_folder_keeps_the_temperature_and_reloads_to_its_logits(run, ministral_dir, tmp_path):
    out = tmp_path / "y2"
    res = run("patch", "--model", ministral_dir, "--strategy", "yarn:factor=2,temperature=native", "-o", out,
              "--serve-length", 2 * W, "-q")
    assert res.exit_code == 0, res.output
    record = json.loads((out / "ropescale.json").read_text())
    assert record["temperature"] == "native" and record["base_rope_parameters"]["llama_4_scaling_beta"] == BETA
    source = ropescale.load_model(str(ministral_dir), device="cpu")[0]
    yarn = {"rope_type": "yarn", "factor": 2.0}
    kept = _ministral(BETA, yarn, source.config.vocab_size, 2 * W)  # transformers' own YaRN with β kept
    dropped = _ministral(0.0, yarn, source.config.vocab_size, 2 * W)
    for m in (kept, dropped):
        m.load_state_dict(source.state_dict())
    with torch.no_grad():
        assert (kept(IDS).logits - dropped(IDS).logits).abs().max() > 1e-2  # β matters at these positions
        saved = ropescale.load_model(str(out), device="cpu")[0](IDS).logits
        torch.testing.assert_close(saved, kept(IDS).logits, rtol=0, atol=1e-4)
        with ropescale.patch(source, "yarn", factor=2.0, temperature="native"):
            torch.testing.assert_close(saved, source(IDS).logits, rtol=0, atol=1e-4)


def test_vllm_export_and_profiles_serve_the_temperature(run, ministral_dir, tmp_path):
    res = run("patch", "--model", ministral_dir, "--strategy", "yarn:factor=2,temperature=native", "-o",
              tmp_path / "v", "--engine", "vllm", "--serve-length", 2 * W, "-q")
    assert res.exit_code == 0, res.output
    want = {"beta": BETA, "original_max_position_embeddings": W}
    assert json.loads((tmp_path / "v" / "config.json").read_text())["llama_4_scaling"] == want
    res = run("patch", "--model", ministral_dir, "--strategy", "yarn:temperature=native", "--profiles", "1,2", "-o",
              tmp_path / "p", "--engine", "vllm", "-q")
    assert res.exit_code == 0, res.output
    record = json.loads((tmp_path / "p" / "profiles.json").read_text())
    assert record["patch_options"]["temperature"] == "native"
    for p in record["profiles"]:
        assert json.loads((tmp_path / "p" / p["path"] / "config.json").read_text())["llama_4_scaling"] == want
