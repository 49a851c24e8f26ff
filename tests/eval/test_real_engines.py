"""`ropescale parity` with the real engines, each in its own environment (bench/engines/install.sh; found
through ROPESCALE_VLLM_PYTHON / ROPESCALE_LLAMA_CPP_PYTHON or the install prefixes). Marked ``engines``;
skipped where an engine is absent, so CI without them passes. The oracles are the engines themselves:
their own rotary code and their log-probabilities of the same token ids, against the patched
ropescale model — and, so that each check can fail, the configs the issue found wrong (llama.cpp's
converter on ``save_patched``'s folder, vLLM given that folder's config as written)."""

import json
import math

import pytest

from eval import engines
from eval.parity import e2e_numbers, run_parity
from ropescale.runs.config import parse_strategy

HAS_VLLM = engines.engine_python("vllm") is not None
HAS_LLAMA = engines.engine_python("llama.cpp") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason=engines.engine_status("vllm"))
needs_llama = pytest.mark.skipif(not HAS_LLAMA or engines.llama_cpp_source() is None,
                                 reason=engines.engine_status("llama.cpp") if not HAS_LLAMA else
                                 "llama.cpp's converter source not found (ROPESCALE_LLAMA_CPP_SOURCE)")
pytestmark = pytest.mark.engines

# every frequency strategy with an export: on the tiny model (T = 32, d = 16) for the rotation, on the
# bundled one (T = 128, d = 32; trained, so a wrong rotation moves its log-probabilities) end to end
FREQUENCY = ["vanilla", "linear", "ntk", "dynamic_ntk", "yarn", "yarn:attention_factor=1.0", "llama3",
             "longrope:short_factor=[1,1,1,1,1,1,1,1],long_factor=[1,1.3,1.8,2.5,3.2,3.7,4,4]"]
BUNDLED = [*FREQUENCY[:-1], "longrope:short_factor=[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],"
           "long_factor=[1,1.2,1.45,1.8,2.3,2.9,3.6,4.4,5.2,6,6.6,7.1,7.5,7.8,8,8]"]


def _rows(model, specs, lengths, engine, **kw):
    rows, _ = run_parity(str(model), [parse_strategy(s) for s in specs], lengths, engines=[engine], **kw)
    return rows


@needs_llama
def test_llama_cpp_serves_every_gguf_export_as_ropescale(tmp_path):
    rows = _rows("reference", BUNDLED + ["yarn:beta_fast=16,beta_slow=2"], [512], "llama.cpp",
                 end_to_end=True, data="kjv-heldout", output=tmp_path)
    for r in rows:
        if r.strategy.startswith("yarn:beta_fast"):
            assert r.verdict.startswith("refused: llama.cpp:"), r.verdict
            continue
        assert r.verdict == "same", (r.strategy, r.length, r.verdict)
        assert r.source.startswith("llama.cpp 0.3.") and "runtime metadata" in r.source
        assert r.nan_positions == 0 and r.max_abs_dlogp < 1e-3, (r.strategy, r.length, r.max_abs_dlogp)
        assert r.ppl_engine == pytest.approx(r.ppl_ropescale, rel=1e-4)


@needs_llama
def test_llama_cpp_serves_a_gemma3_export_layer_type_by_layer_type(tmp_path, tiny_gemma3_dir, text_file):
    """Gemma 3's global layers scaled, its sliding-window layers kept: llama.cpp's converter GGUF of the
    model with the rope keys rewritten, scored by llama.cpp (measured: within 2.3e-4 nats; the patch
    itself moves log p by ~5e-2 on this model)."""
    rows = _rows(tiny_gemma3_dir, ["yarn:factor=4", "linear:factor=4"], [256], "llama.cpp", end_to_end=True,
                 data=str(text_file), output=tmp_path)
    for r in rows:
        assert r.verdict == "same (per layer type: full_attention, sliding_attention)", (r.strategy, r.verdict)
        assert r.nan_positions == 0 and r.max_abs_dlogp < 1e-3, (r.strategy, r.max_abs_dlogp)


@needs_llama
def test_llama_cpp_end_to_end_detects_what_the_converter_loses(tmp_path):
    """The issue's finding, reproduced: the converter's GGUF of save_patched's folder loses a
    non-default YaRN attention_factor (and dynamic NTK): llama.cpp then scores the text differently
    from the patched model, and the end-to-end numbers show it."""
    import ropescale
    from eval.engines.base import our_logprobs
    from eval.parity import _windows

    src = engines.llama_cpp_source()
    cases = (("yarn", {"factor": 4.0, "attention_factor": 1.0}), ("dynamic_ntk", {}))
    ours, ids = {}, None
    for spec, params in cases:
        m, tok = ropescale.load_model("reference", device="cpu")
        ropescale.unpatch(m)
        ropescale.patch(m, spec, **params)
        ropescale.save_patched(m, tok, tmp_path / spec)
        ids = ids or _windows(tok, "kjv-heldout", [512], 1)[512]
        ours[spec] = our_logprobs(m, ids)
    # one converter process and one llama.cpp process for both cases (each starts in seconds)
    engines.run_engine("llama.cpp", {"mode": "convert", "source": str(src), "outtype": "f32", "jobs": [
        {"model": str(tmp_path / spec), "out": str(tmp_path / f"{spec}.gguf")} for spec, _ in cases]},
        script="convert_gguf.py")
    got = engines.run_engine("llama.cpp", {"mode": "logprobs", "jobs": [
        {"gguf": str(tmp_path / f"{spec}.gguf"), "n_ctx": 512, "ids": ids} for spec, _ in cases]})
    for (spec, _), job in zip(cases, got["jobs"]):
        diff = e2e_numbers(ours[spec], job["logprobs"])
        assert diff["max_abs_dlogp"] > 1e-2, (spec, diff)


@needs_llama
def test_the_converter_wrapper_maps_only_a_byte_level_pre_tokenizer(tmp_path, tiny_model_dir):
    """The bundled tokenizer's hash is unknown to the converter; the wrapper names it gpt-2 (its
    pre-tokenizer is GPT-2's ByteLevel) and the GGUF's token ids are transformers' (checked end to end
    above); another pre-tokenizer with an unknown hash stays refused."""
    import shutil

    src = engines.llama_cpp_source()
    got = engines.run_engine("llama.cpp", {"mode": "convert", "model": str(tiny_model_dir),
                                           "out": str(tmp_path / "a.gguf"), "source": str(src)},
                             script="convert_gguf.py")
    assert got["pre"] == "gpt-2"
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, tok["pre_tokenizer"]]}
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(engines.EngineFailed):
        engines.run_engine("llama.cpp", {"mode": "convert", "model": str(other), "out": str(tmp_path / "b.gguf"),
                                         "source": str(src)}, script="convert_gguf.py", log_dir=tmp_path / "logs")
    assert "BPE pre-tokenizer was not recognized" in (tmp_path / "logs" / "llama-convert.log").read_text()
    assert not (tmp_path / "b.gguf").exists() or (tmp_path / "b.gguf").stat().st_size == 0


@needs_vllm
def test_vllm_rotary_classes_compute_every_export_as_ropescale(tiny_model_dir, tmp_path):
    """vLLM's own ModelConfig and get_rope on each exported config.json, every position up to L."""
    rows = _rows(tiny_model_dir, FREQUENCY + ["yarn:beta_fast=16,beta_slow=2"], [64, 128], "vllm", output=tmp_path)
    for r in rows:
        assert r.verdict == "same", (r.strategy, r.length, r.verdict)
        assert r.source.startswith("vLLM 0.") and "get_rope" in r.source
        assert r.max_angle_diff < 1e-4 and r.max_rel_freq_diff <= 1e-5


@needs_vllm
def test_vllm_rotary_classes_show_the_known_non_parities(tiny_model_dir, tmp_path, monkeypatch):
    """Configs the issue measured wrong, through vLLM's own code: never 'same'."""
    from eval.engines.base import link_model
    from eval.engines.vllm_engine import _fill_real
    from ropescale import load_model, patch, unpatch
    from ropescale.serving.rope import ropescale_rope

    m, _ = load_model(str(tiny_model_dir), device="cpu")
    unpatch(m)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    cases = {  # rope_parameters, max_position_embeddings, strategy patched on our side
        "vllm-ntk-type": ({"rope_type": "ntk", "factor": 4.0}, 128, ("ntk", {"factor": 4.0})),
        "dynamic-no-trained": ({"rope_type": "dynamic", "factor": 1.0}, 128, ("dynamic_ntk", {})),
        "yarn-short-cache": ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}, 64,
                             ("yarn", {"factor": 2.0})),
    }
    requests, expected = [], []
    for name, (rp, mpe, (strategy, params)) in cases.items():
        folder = link_model(tiny_model_dir, tmp_path / name,
                             {**config, "max_position_embeddings": mpe,
                              "rope_parameters": {"rope_theta": 10000.0, **rp}})
        requests.append({"model": str(folder), "max_model_len": 128, "length": 128})
        with patch(m, strategy, **params):
            expected.append(ropescale_rope(m, 128))
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # let the short cache through to the rotation
    got = engines.run_engine("vllm", {"mode": "rope", "cases": requests})
    from eval.parity import ParityRow

    for (name, _), ours, case in zip(cases.items(), expected, got["cases"]):
        row = ParityRow("vllm", name, 128, "", "")
        _fill_real(row, ours, {None: case}, 128, got["vllm"])
        assert row.same is False and row.verdict.startswith("differs:"), (name, row.verdict)
    assert "cache holds 64 positions" in row.verdict and row.max_angle_diff == math.inf


@needs_vllm
def test_vllm_reads_each_gemma3_layer_types_rope_as_ropescale(tmp_path, tiny_gemma3_dir):
    """vLLM's ModelConfig on the exported folder, then get_rope with each layer type's parameters as its
    Gemma 3 attention passes them: every type the same as ropescale's (the sliding ones as shipped)."""
    rows = _rows(tiny_gemma3_dir, ["yarn:factor=4", "linear:factor=4"], [256], "vllm", output=tmp_path)
    for r in rows:
        assert r.verdict == "same (per layer type: full_attention, sliding_attention)", (r.strategy, r.verdict)
        assert r.source.startswith("vLLM 0.") and r.max_angle_diff < 1e-3


@needs_vllm
def test_vllm_end_to_end_matches_ropescale_for_one_export(tmp_path):
    """One vLLM start (about 20 s; the bundled model: vLLM's CPU attention has no kernel for head_dim 16)."""
    rows = _rows("reference", ["yarn"], [512], "vllm", end_to_end=True, data="kjv-heldout", output=tmp_path)
    r = rows[0]
    assert r.verdict == "same" and r.nan_positions == 0 and r.max_abs_dlogp < 1e-3, r


_REFUSAL_CASES = {  # rope_parameters of save_patched's config.json (max_position_embeddings left at T = 32)
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 1.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}


@needs_vllm
@pytest.mark.parametrize("kind", [
    "linear", "dynamic", "llama3", "yarn",
])
def test_vllm_rope_says_when_vllm_refuses_a_length_as_vllm_does(tiny_model_dir, tmp_path, monkeypatch, kind):
    """vLLM's own ModelConfig (no VLLM_ALLOW_LONG_MAX_MODEL_LEN) against vllm_rope's ``failure`` on the
    configs save_patched writes, served at 4T = 128."""
    from eval.engines.base import link_model
    from ropescale.serving.engines.vllm import vllm_rope

    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    config = {**json.loads((tiny_model_dir / "config.json").read_text()), "max_position_embeddings": 32,
              "rope_parameters": {"rope_theta": 10000.0, **_REFUSAL_CASES[kind]}}
    folder = link_model(tiny_model_dir, tmp_path / kind, config)
    got = engines.run_engine("vllm", {"mode": "rope", "cases": [{"model": str(folder), "max_model_len": 128,
                                                                "length": 128}]})["cases"][0]
    vllm_refuses = "max_model_len" in got.get("error", "")
    mine = vllm_rope(config, 128).failure or ""
    assert vllm_refuses == ("refuses max_model_len" in mine), (got.get("error"), mine)


@needs_vllm
def test_vllm_rope_reimplementation_matches_vllm_reading_the_exported_folder(tiny_model_dir, tmp_path):
    """ropescale.serving.vllm_rope against vLLM itself reading each exported config.json
    (ModelConfig's rope standardisation, then get_rope): θ within 1e-5 relative, magnitude within 1e-6."""
    import torch

    from eval.engines.base import link_model
    from ropescale import load_model, patch, unpatch
    from ropescale.serving.engines.vllm import export_vllm, vllm_rope
    from ropescale.strategies import get_strategy

    m, _ = load_model(str(tiny_model_dir), device="cpu")
    unpatch(m)
    cases, mine = [], []
    for text in FREQUENCY:
        spec = parse_strategy(text)
        for length in (64, 128):
            params = get_strategy(spec.name).resolve(spec.params, length=length, train_length=32)
            with patch(m, spec.name, **params) as handle:
                freeze = length if spec.name == "dynamic_ntk" else None  # the other rules refuse it
                export = export_vllm(handle, length, freeze_dynamic_at=freeze)
            folder = link_model(tiny_model_dir, tmp_path / f"{spec.name}-{len(cases)}", export.config)
            cases.append({"model": str(folder), "max_model_len": export.max_model_len, "length": length})
            mine.append((text, length, vllm_rope(export.config, export.max_model_len)))
    got = engines.run_engine("vllm", {"mode": "rope", "cases": cases})["cases"]
    for (text, length, rope), real in zip(mine, got):
        assert "error" not in real, (text, length, real.get("error"))
        theirs = torch.tensor(real["inv_freq"], dtype=torch.float64)
        assert torch.allclose(theirs, rope.inv_freq, rtol=1e-5, atol=0), (text, length)
        assert abs(real["magnitude"] - rope.magnitude) <= 1e-6, (text, length)
        assert rope.failure is None and real["evaluated"] == length, (text, length, rope.failure)
