"""llama.cpp: every frequency strategy written into a GGUF and read back by llama_cpp_rope gives
ropescale's rotation; llama_cpp_rope checked against llama.cpp's formulas written out here from
its source (src/llama-model.cpp load_hparams, src/llama-context.cpp cparams,
ggml/src/ggml-cpu/ops.cpp rope_yarn*); the GGUF round trip through gguf's reader; every known
non-parity detected and named. Gemma 3: its llama.cpp architecture rotates the sliding-window layers
at ``rope.freq_base_swa``, unscaled, and the global ones with the rope keys (src/models/gemma3.cpp,
``llama_model::get_rope_freq_base/scale``)."""

import math

import numpy as np
import pytest
import torch

from ropescale.errors import InvalidInput
from ropescale.serving import (
    ExportRefused,
    compare,
    gguf_rope,
    llama_cpp_rope,
    read_gguf_rope,
    rewrite_gguf,
    ropescale_rope,
)
from ropescale.serving.engines.llama_cpp import llama_cpp_layer_ropes
from ropescale.serving.gguf import ROPE_TENSORS
from ropescale.serving.rope import compare_layers, ropescale_layer_ropes
from tests.conftest import tiny_gemma3_config, tiny_llama_config
from tests.serving.conftest import (
    FREQUENCY,
    G_D,
    G_T,
    GLOBAL,
    LOCAL,
    LONG,
    RELATIVE,
    SHORT,
    THETA,
    D,
    T,
    gemma3_patched,
    patched,
)
from tests.serving.tiny_gguf import write_tiny_gemma3_gguf, write_tiny_llama_gguf

gguf = pytest.importorskip("gguf")
V = gguf.GGUFValueType
FREQ_TOL, MAG_TOL = 1e-5, 1e-6
SERVED = sorted(set(FREQUENCY) - {"yarn_betas"})  # refused: the llama architecture never reads them


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory):
    """A tiny Llama GGUF as a converter writes it, with a stale yarn setup and rope_freqs to replace."""
    path = tmp_path_factory.mktemp("gguf") / "base.gguf"
    stale = {"llama.rope.scaling.type": ("yarn", V.STRING), "llama.rope.scaling.factor": (2.0, V.FLOAT32),
             "llama.rope.scaling.yarn_log_multiplier": (0.1, V.FLOAT32)}
    return write_tiny_llama_gguf(path, tiny_llama_config(), extra_kv=stale,
                                 extra_tensors={"rope_freqs.weight": np.full(D // 2, 3.0, dtype=np.float32)})


def _freeze(case, length):
    return length if case == "dynamic_ntk" else None


@pytest.mark.parametrize("length", [48, 256])
@pytest.mark.parametrize("case", SERVED)
def test_every_frequency_strategy_is_served_exactly(case, length, base_gguf, tmp_path):
    name, params = FREQUENCY[case]
    model = patched(name, **params)
    rope = gguf_rope(model, length, freeze_dynamic_at=_freeze(case, length))
    out = rewrite_gguf(base_gguf, tmp_path / "model.gguf", rope)
    kv, tensors = read_gguf_rope(out)
    theirs = llama_cpp_rope(kv, tensors, length, D)
    ours = ropescale_rope(model, length)
    assert theirs.failure is None
    assert torch.allclose(theirs.inv_freq, ours.inv_freq, rtol=FREQ_TOL, atol=0)
    assert abs(theirs.magnitude - ours.magnitude) <= MAG_TOL
    verdict = compare(ours, theirs, length)
    assert verdict.same, verdict.verdict


def test_the_round_trip_keeps_every_other_key_and_tensor_with_its_type(base_gguf, tmp_path):
    rope = gguf_rope(patched("llama3", factor=4.0), 256)
    out = rewrite_gguf(base_gguf, tmp_path / "model.gguf", rope)
    src, dst = gguf.GGUFReader(base_gguf), gguf.GGUFReader(out)
    rope_keys = {k for k in src.fields if k.startswith("llama.rope.") and k not in
                 ("llama.rope.dimension_count", "llama.rope.scaling.finetuned")}
    for name, field in src.fields.items():
        if name.startswith("GGUF.") or name in rope_keys:
            continue
        copied = dst.fields[name]
        assert copied.types == field.types, name
        assert copied.contents() == field.contents(), name
    for key, (value, vtype) in rope.kv.items():
        assert dst.fields[key].types == [vtype]
        assert dst.fields[key].contents() == (pytest.approx(value) if isinstance(value, float) else value)
    assert "llama.rope.scaling.factor" not in dst.fields  # the stale yarn setup is gone
    assert "llama.rope.scaling.yarn_log_multiplier" not in dst.fields
    src_t = {t.name: t for t in src.tensors}
    dst_t = {t.name: t for t in dst.tensors}
    assert set(dst_t) == set(src_t)
    for name, t in src_t.items():
        if name in ROPE_TENSORS:
            continue
        assert dst_t[name].tensor_type == t.tensor_type and list(dst_t[name].shape) == list(t.shape)
        assert np.array_equal(np.asarray(dst_t[name].data), np.asarray(t.data))
    assert dst_t["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert np.array_equal(np.asarray(dst_t["rope_freqs.weight"].data), rope.tensors["rope_freqs.weight"])


def test_vanilla_export_drops_the_old_rope_tensor(base_gguf, tmp_path):
    out = rewrite_gguf(base_gguf, tmp_path / "model.gguf", gguf_rope(patched("vanilla"), 256))
    assert "rope_freqs.weight" not in {t.name for t in gguf.GGUFReader(out).tensors}


def test_the_export_follows_the_measured_rules():
    yarn = gguf_rope(patched("yarn", factor=4.0, attention_factor=1.3), 256).kv
    assert yarn["llama.rope.scaling.type"] == ("yarn", V.STRING)
    assert yarn["llama.rope.scaling.attn_factor"][0] == pytest.approx(1.3 / (0.1 * math.log(4) + 1))
    assert yarn["llama.rope.scaling.original_context_length"] == (T, V.UINT32)
    ntk = gguf_rope(patched("ntk", factor=4.0), 256).kv
    assert ntk["llama.rope.freq_base"][0] == pytest.approx(THETA * 4 ** (D / (D - 2)))
    llama3 = gguf_rope(patched("llama3", factor=4.0), 256)
    divisors = []
    for i in range(D // 2):  # the converter's rope_factors, from the model's own window T
        wl = 2 * math.pi * THETA ** (2 * i / D)
        smooth = (T / wl - 1.0) / (4.0 - 1.0)
        divisors.append(1.0 if wl < T / 4 else 4.0 if wl > T else 1 / ((1 - smooth) / 4 + smooth))
    assert llama3.tensors["rope_freqs.weight"].tolist() == pytest.approx(divisors, rel=1e-6)
    assert gguf_rope(patched("longrope", factor=4.0, short_factor=SHORT, long_factor=LONG), 48) \
        .tensors["rope_freqs.weight"].tolist() == pytest.approx(SHORT)
    assert gguf_rope(patched("vanilla"), 256, arch="qwen2").kv["qwen2.rope.scaling.type"] == ("none", V.STRING)


@pytest.mark.parametrize("name", sorted(RELATIVE))
def test_relative_rules_are_refused_naming_llama_cpp(name):
    from ropescale.strategies import strategy_names

    if name not in strategy_names():
        pytest.skip(f"{name} not registered")
    with pytest.raises(ExportRefused, match=f"^llama.cpp: {name} is a relative-position rule"):
        gguf_rope(patched(name, **RELATIVE[name]), 256)


@pytest.mark.parametrize(("name", "params", "match"), [
    ("ntk", {"factor": 2.0, "logn": True}, "query temperature"),
    ("yarn", {"factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0}, "never reads rope.scaling.yarn_beta"),
    ("dynamic_ntk", {"factor": 2.0}, "freeze"),
    ("ntk_by_parts", {"factor": 2.0}, "no transformers rope type"),
])
def test_what_llama_cpp_cannot_express_is_refused_in_one_line(name, params, match):
    with pytest.raises(ExportRefused, match=match) as err:
        gguf_rope(patched(name, **params), 256)
    assert str(err.value).startswith("llama.cpp: ") and "\n" not in str(err.value)


def test_bad_files_are_one_line_errors(tmp_path, base_gguf):
    rope = gguf_rope(patched("vanilla"), 256)
    with pytest.raises(InvalidInput, match="no such GGUF"):
        rewrite_gguf(tmp_path / "missing.gguf", tmp_path / "out.gguf", rope)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(InvalidInput, match="not a readable GGUF"):
        rewrite_gguf(tmp_path / "junk.gguf", tmp_path / "out.gguf", rope)
    with pytest.raises(InvalidInput, match="over the source"):
        rewrite_gguf(base_gguf, base_gguf, rope)


def _cuts(size: int) -> list[int]:
    """Lengths to cut a GGUF of ``size`` bytes at: every one inside the magic, version and counts
    (24 bytes) and the first key, then about fifty through the key/values, tensor infos and data."""
    return sorted(set(range(0, 40)) | set(range(40, size, max(1, size // 47))))


def test_a_gguf_cut_short_anywhere_is_one_line(tmp_path, base_gguf):
    """gguf-py's reader raises IndexError inside the header and ValueError elsewhere: each a
    one-line InvalidInput from both readers, and nothing written."""
    import re

    data = base_gguf.read_bytes()
    rope = gguf_rope(patched("vanilla"), 256)
    cut, out = tmp_path / "cut.gguf", tmp_path / "out" / "model.gguf"
    for n in _cuts(len(data)):
        cut.write_bytes(data[:n])
        for read in (lambda: rewrite_gguf(cut, out, rope), lambda: read_gguf_rope(cut)):
            with pytest.raises(InvalidInput, match=f"^{re.escape(str(cut))}: not a readable GGUF") as err:
                read()
            assert "\n" not in str(err.value), n
    assert not out.parent.exists()


# ---- llama_cpp_rope against llama.cpp's formulas, written out from its source ---------------------

def _kv(**rope):
    return {"general.architecture": "llama", "llama.context_length": T, "llama.rope.freq_base": THETA,
            **{f"llama.rope.{k}": v for k, v in rope.items()}}


def _theta():
    return [THETA ** (-2 * i / D) for i in range(D // 2)]


def _close(engine, expected, magnitude=1.0):
    assert engine.inv_freq.tolist() == pytest.approx(expected, rel=FREQ_TOL)
    assert engine.magnitude == pytest.approx(magnitude, abs=MAG_TOL)


def test_llama_cpp_scaling_types():
    _close(llama_cpp_rope(_kv(**{"scaling.type": "none"}), {}, 256, D), _theta())
    # no rope.scaling.type: llama-model.cpp reads "linear", with factor 0 → freq_scale 1
    _close(llama_cpp_rope(_kv(), {}, 256, D), _theta())
    _close(llama_cpp_rope(_kv(**{"scaling.type": "linear", "scaling.factor": 4.0}), {}, 256, D),
           [f / 4 for f in _theta()])
    # type none ignores a factor (llama-context.cpp: freq_scale = 1 when scaling type is none)
    _close(llama_cpp_rope(_kv(**{"scaling.type": "none", "scaling.factor": 4.0}), {}, 256, D), _theta())
    divisors = np.linspace(1, 4, D // 2).astype(np.float32)
    _close(llama_cpp_rope(_kv(**{"scaling.type": "none", "scaling.attn_factor": 1.2}),
                          {"rope_freqs.weight": divisors}, 256, D),
           [f / x for f, x in zip(_theta(), divisors.tolist())], 1.2)
    bad = llama_cpp_rope(_kv(**{"scaling.type": "dynamic"}), {}, 256, D)
    assert "aborts loading" in bad.failure


def test_llama_cpp_yarn_ramp_betas_and_magnitude():
    s = 4.0

    def corr(rot):  # ggml_rope_yarn_corr_dim
        return D * math.log(T / (rot * 2 * math.pi)) / (2 * math.log(THETA))

    def expected(beta_fast, beta_slow):
        low, high = max(0, math.floor(corr(beta_fast))), min(D - 1, math.ceil(corr(beta_slow)))
        out = []
        for i, f in enumerate(_theta()):
            mix = 1 - min(1, max(0, (i - low) / max(0.001, high - low)))  # rope_yarn_ramp, ext_factor 1
            out.append(f / s * (1 - mix) + f * mix)
        return out

    kv = _kv(**{"scaling.type": "yarn", "scaling.factor": s, "scaling.original_context_length": T})
    _close(llama_cpp_rope(kv, {}, 256, D), expected(32, 1), 0.1 * math.log(s) + 1)
    _close(llama_cpp_rope(kv, {}, 256, D, yarn_beta_fast=16, yarn_beta_slow=2), expected(16, 2), 0.1 * math.log(s) + 1)
    # rope.scaling.yarn_beta_* in the GGUF: not read by the llama architecture
    with_betas = {**kv, "llama.rope.scaling.yarn_beta_fast": 16.0, "llama.rope.scaling.yarn_beta_slow": 2.0}
    _close(llama_cpp_rope(with_betas, {}, 256, D), expected(32, 1), 0.1 * math.log(s) + 1)
    # the runtime yarn_attn_factor is overwritten; rope.scaling.attn_factor multiplies in
    _close(llama_cpp_rope(kv, {}, 256, D, yarn_attn_factor=2.0), expected(32, 1), 0.1 * math.log(s) + 1)
    _close(llama_cpp_rope({**kv, "llama.rope.scaling.attn_factor": 0.9}, {}, 256, D), expected(32, 1),
           0.9 * (0.1 * math.log(s) + 1))


def test_llama_cpp_yarn_ramp_is_the_truncated_one():
    """Measured: llama.cpp floors/ceils the correction dims always, as transformers/vLLM do with
    ``truncate: true`` (ropescale's yarn); an unrounded ramp (``truncate: false``) differs by up to
    65% on one pair at s = 8 on the bundled model's shape (d = 32, T = 128)."""
    from ropescale.serving import vllm_rope

    kv = _kv(**{"scaling.type": "yarn", "scaling.factor": 8.0, "scaling.original_context_length": T})
    ours = llama_cpp_rope(kv, {}, 512, D)
    for truncate, same in ((True, True), (False, False)):
        config = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 512,
                  "rope_parameters": {"rope_theta": THETA, "rope_type": "yarn", "factor": 8.0,
                                      "original_max_position_embeddings": T, "truncate": truncate}}
        assert compare(vllm_rope(config, 512), ours, 512).same is same


def test_llama_cpp_longrope_chooses_factors_once_by_the_padded_context_size():
    tensors = {"rope_factors_long.weight": np.array(LONG, np.float32),
               "rope_factors_short.weight": np.array(SHORT, np.float32),
               "rope_freqs.weight": np.full(D // 2, 9.0, np.float32)}  # not loaded under longrope
    long = [f / x for f, x in zip(_theta(), LONG)]
    short = [f / x for f, x in zip(_theta(), SHORT)]
    phi3 = {"general.architecture": "phi3", "phi3.context_length": 4096, "phi3.rope.freq_base": THETA,
            "phi3.rope.scaling.original_context_length": 512}
    _close(llama_cpp_rope(phi3, tensors, 600, D), long)  # 600 → 768 > 512
    _close(llama_cpp_rope(phi3, tensors, 512, D), short)
    llama = _kv(**{"scaling.type": "longrope", "scaling.original_context_length": T})
    _close(llama_cpp_rope(llama, tensors, 48, D), long)  # 48 → 256 > T: long factors even for short contexts


# ---- known non-parities: detected and named, never "same" ----------------------------------------

def _differs(model, kv, tensors, length, **runtime):
    verdict = compare(ropescale_rope(model, length), llama_cpp_rope(kv, tensors, length, D, **runtime), length)
    assert not verdict.same and verdict.verdict.startswith("differs: ")
    return verdict.verdict


YARN_KV = _kv(**{"scaling.type": "yarn", "scaling.factor": 4.0, "scaling.original_context_length": T})


def test_attention_factor_is_lost_without_the_attn_factor_key():
    model = patched("yarn", factor=4.0, attention_factor=1.3)
    assert "magnitude" in _differs(model, YARN_KV, {}, 256)
    assert "magnitude" in _differs(model, YARN_KV, {}, 256, yarn_attn_factor=1.3 / (0.1 * math.log(4) + 1))


def test_betas_in_the_gguf_are_lost():
    model = patched("yarn", factor=4.0, beta_fast=16.0, beta_slow=2.0)
    kv = {**YARN_KV, "llama.rope.scaling.yarn_beta_fast": 16.0, "llama.rope.scaling.yarn_beta_slow": 2.0}
    assert "frequencies differ" in _differs(model, kv, {}, 256)


def test_llama3_divisors_from_the_converters_default_window_differ():
    model = patched("llama3", factor=4.0)
    divisors = []
    for i in range(D // 2):  # convert_hf_to_gguf with old_context_len = 8192 (its default)
        wl = 2 * math.pi * THETA ** (2 * i / D)
        smooth = (8192 / wl - 1.0) / 3.0
        divisors.append(1.0 if wl < 8192 / 4 else 4.0 if wl > 8192 else 1 / ((1 - smooth) / 4 + smooth))
    kv = _kv(**{"scaling.type": "none"})
    assert "frequencies differ" in _differs(model, kv, {"rope_freqs.weight": np.array(divisors, np.float32)}, 256)


def test_longrope_type_serves_long_factors_below_the_window():
    model = patched("longrope", factor=4.0, short_factor=SHORT, long_factor=LONG)
    tensors = {"rope_factors_long.weight": np.array(LONG, np.float32),
               "rope_factors_short.weight": np.array(SHORT, np.float32)}
    kv = _kv(**{"scaling.type": "longrope", "scaling.original_context_length": T})
    assert "frequencies differ" in _differs(model, kv, tensors, 48)


def test_dynamic_ntk_dropped_by_the_converter_runs_vanilla():
    assert "frequencies differ" in _differs(patched("dynamic_ntk", factor=2.0), _kv(), {}, 256)


def test_a_source_aligned_to_64_round_trips_with_identical_tensors(tmp_path):
    src = tmp_path / "src64.gguf"
    w = gguf.GGUFWriter(src, "llama")
    w.add_custom_alignment(64)
    w.add_context_length(T)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(THETA)
    w.add_key_value("tiny.u8", 7, V.UINT8)
    w.add_tensor("a.weight", np.arange(3, dtype=np.float32))
    w.add_tensor("b.weight", np.arange(5, dtype=np.float16))
    w.add_tensor("rope_freqs.weight", np.ones(D // 2, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = rewrite_gguf(src, tmp_path / "model.gguf", gguf_rope(patched("linear", factor=4.0), 256))
    before, after = gguf.GGUFReader(src), gguf.GGUFReader(out)
    assert after.alignment == 64
    assert [f.name for f in after.fields.values()].count("general.alignment") == 1
    assert after.fields["general.alignment"].contents() == 64
    assert after.fields["tiny.u8"].contents() == 7
    kept = {t.name: t for t in before.tensors if t.name not in ROPE_TENSORS}
    got = {t.name: t for t in after.tensors}
    assert set(kept) <= set(got)
    for name, t in kept.items():
        assert got[name].tensor_type == t.tensor_type
        assert np.array_equal(got[name].data, t.data), name
        assert got[name].data_offset % 64 == 0


@pytest.mark.parametrize(("change", "match"), [
    ({"hidden_size": 32}, r"dimension_count 8 but the patched model's rotary dim is 16"),
    ({"rope_theta": 500000.0}, r"freq_base 500000 but the patched model's rope_theta is 10000"),
])
def test_a_gguf_of_another_model_is_refused_before_writing(change, match, tmp_path):
    config = tiny_llama_config()  # the GGUF's model: 32 hidden / 4 heads is rotary dim 8
    if "hidden_size" in change:
        config.hidden_size = change["hidden_size"]
    else:
        config.rope_parameters = {**config.rope_parameters, "rope_theta": change["rope_theta"]}
    src = write_tiny_llama_gguf(tmp_path / "other.gguf", config)
    out = tmp_path / "out" / "model.gguf"
    with pytest.raises(ExportRefused, match=match) as err:
        rewrite_gguf(src, out, gguf_rope(patched("linear", factor=4.0), 256))
    assert "\n" not in str(err.value) and str(src) in str(err.value)
    assert not out.parent.exists()


@pytest.mark.parametrize("arch", ["phi3", "phimoe"])
def test_longrope_is_refused_where_llama_cpp_reads_rope_factors_long_short(arch, tmp_path):
    name, params = FREQUENCY["longrope"]
    model = patched(name, **params)
    match = f"^llama.cpp: the {arch} architecture reads rope_factors_long/short, never rope_freqs"
    with pytest.raises(ExportRefused, match=match) as err:
        gguf_rope(model, 256, arch=arch)
    assert "\n" not in str(err.value)
    src = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(src, arch)
    w.add_context_length(T)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(THETA)
    w.add_tensor("a.weight", np.arange(3, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "out" / "model.gguf"
    with pytest.raises(ExportRefused, match=match):
        rewrite_gguf(src, out, gguf_rope(model, 256))
    assert not out.parent.exists()


# ---- Gemma 3: sliding-window layers at rope.freq_base_swa, global layers with the rope keys --------

GEMMA3 = {"yarn": ("yarn", {"factor": 4.0}), "linear": ("linear", {"factor": 4.0}), "ntk": ("ntk", {"factor": 4.0}),
          "dynamic_ntk": ("dynamic_ntk", {"factor": 2.0})}
SWA = {"sliding_attention": True, "full_attention": False}


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    """A tiny Gemma 3 GGUF as llama.cpp's converter writes it, with a stale linear ×8 on its global layers."""
    stale = {"gemma3.rope.scaling.type": ("linear", V.STRING), "gemma3.rope.scaling.factor": (8.0, V.FLOAT32)}
    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("gemma3") / "base.gguf", tiny_gemma3_config(),
                                  extra_kv=stale)


@pytest.mark.parametrize("length", [128, 256])
@pytest.mark.parametrize("case", sorted(GEMMA3))
def test_gemma3_global_patch_is_written_for_llama_cpps_global_layers(case, length, gemma3_gguf, tmp_path):
    name, params = GEMMA3[case]
    model = gemma3_patched(name, **params)
    rope = gguf_rope(model, length, freeze_dynamic_at=length if name == "dynamic_ntk" else None)
    assert rope.arch == "gemma3" and rope.swa_types == SWA
    out = rewrite_gguf(gemma3_gguf, tmp_path / "model.gguf", rope)
    kv, tensors = read_gguf_rope(out)
    assert kv["gemma3.rope.freq_base_swa"] == LOCAL and kv["gemma3.attention.sliding_window"] == 16
    theirs = llama_cpp_layer_ropes(kv, tensors, length, G_D, rope.swa_types)
    assert all(t.failure is None for t in theirs.values())
    verdict = compare_layers(ropescale_layer_ropes(model, length), theirs, length)
    assert verdict.same, verdict.verdict


def test_gemma3_export_writes_the_keys_llama_cpp_applies_to_the_global_layers(gemma3_gguf, tmp_path):
    yarn = gguf_rope(gemma3_patched("yarn", factor=4.0), 256)
    assert yarn.kv == {"gemma3.rope.freq_base": (GLOBAL, V.FLOAT32), "gemma3.rope.scaling.type": ("yarn", V.STRING),
                       "gemma3.rope.scaling.factor": (4.0, V.FLOAT32),
                       "gemma3.rope.scaling.original_context_length": (G_T, V.UINT32),
                       "gemma3.rope.scaling.attn_factor": (pytest.approx(1.0), V.FLOAT32),
                       "gemma3.rope.freq_base_swa": (LOCAL, V.FLOAT32)}
    linear = gguf_rope(gemma3_patched("linear", factor=4.0), 256)
    assert linear.kv == {"gemma3.rope.freq_base": (GLOBAL, V.FLOAT32),
                         "gemma3.rope.scaling.type": ("linear", V.STRING),
                         "gemma3.rope.scaling.factor": (4.0, V.FLOAT32),
                         "gemma3.rope.freq_base_swa": (LOCAL, V.FLOAT32)}
    assert not linear.tensors
    out = rewrite_gguf(gemma3_gguf, tmp_path / "model.gguf", linear)
    kv, _ = read_gguf_rope(out)  # the stale linear ×8 is replaced, every other key copied
    assert kv["gemma3.rope.scaling.factor"] == 4.0 and kv["general.name"] == "tiny-gemma3"
    # the sliding layers' own patched base (NTK is rope_type default): rope.freq_base_swa carries it
    both = gguf_rope(gemma3_patched("ntk", factor=4.0, layer_types=["sliding_attention", "full_attention"]), 256)
    assert both.kv["gemma3.rope.freq_base_swa"][0] == pytest.approx(LOCAL * 4 ** (G_D / (G_D - 2)))


def _gemma3_kv(**rope):
    return {"general.architecture": "gemma3", "gemma3.context_length": G_T, "gemma3.rope.freq_base": GLOBAL,
            "gemma3.rope.freq_base_swa": LOCAL, "gemma3.attention.sliding_window": 16,
            **{f"gemma3.rope.{k}": v for k, v in rope.items()}}


def test_llama_cpp_sliding_layers_rotate_at_their_own_base_unscaled():
    local = [LOCAL ** (-2 * i / G_D) for i in range(G_D // 2)]
    glob = [GLOBAL ** (-2 * i / G_D) for i in range(G_D // 2)]
    linear = _gemma3_kv(**{"scaling.type": "linear", "scaling.factor": 4.0})
    _close(llama_cpp_rope(linear, {}, 256, G_D, sliding=True), local)
    _close(llama_cpp_rope(linear, {}, 256, G_D), [f / 4 for f in glob])
    yarn = _gemma3_kv(**{"scaling.type": "yarn", "scaling.factor": 4.0, "scaling.original_context_length": G_T})
    _close(llama_cpp_rope(yarn, {}, 256, G_D, sliding=True), local)  # the ramp mixes equal frequencies
    assert llama_cpp_rope(yarn, {}, 256, G_D).magnitude == pytest.approx(0.1 * math.log(4) + 1, abs=MAG_TOL)
    # rope.scaling.attn_factor reaches every layer, the sliding ones too
    assert llama_cpp_rope({**yarn, "gemma3.rope.scaling.attn_factor": 0.9}, {}, 256, G_D,
                          sliding=True).magnitude == pytest.approx(0.9, abs=MAG_TOL)
    # no freq_base_swa: llama.cpp's default 10000; no sliding window: every layer is global
    _close(llama_cpp_rope({**linear, "gemma3.rope.freq_base_swa": 500.0}, {}, 256, G_D, sliding=True),
           [500.0 ** (-2 * i / G_D) for i in range(G_D // 2)])
    no_window = {k: v for k, v in linear.items() if k != "gemma3.attention.sliding_window"}
    _close(llama_cpp_rope(no_window, {}, 256, G_D, sliding=True), [f / 4 for f in glob])
    # gemma3's graph passes no frequency factors: a rope_freqs tensor is never read
    _close(llama_cpp_rope(linear, {"rope_freqs.weight": np.full(G_D // 2, 3.0, np.float32)}, 256, G_D),
           [f / 4 for f in glob])


def test_a_wrong_gemma3_key_shows_which_layer_type_differs():
    model = gemma3_patched("yarn", factor=4.0)
    rope = gguf_rope(model, 256)
    ours = ropescale_layer_ropes(model, 256)
    kv = {**_gemma3_kv(), **{k: v[0] for k, v in rope.kv.items()}}
    assert compare_layers(ours, llama_cpp_layer_ropes(kv, {}, 256, G_D, SWA), 256).same
    v = compare_layers(ours, llama_cpp_layer_ropes({**kv, "gemma3.rope.freq_base_swa": GLOBAL}, {}, 256, G_D, SWA),
                       256)
    assert not v.same and v.verdict.startswith("differs: sliding_attention: frequencies differ"), v.verdict
    v = compare_layers(ours, llama_cpp_layer_ropes({**kv, "gemma3.rope.scaling.factor": 2.0}, {}, 256, G_D, SWA), 256)
    assert not v.same and v.verdict.startswith("differs: full_attention: ") and "sliding" not in v.verdict
    no_window = {k: v for k, v in kv.items() if k != "gemma3.attention.sliding_window"}
    v = compare_layers(ours, llama_cpp_layer_ropes(no_window, {}, 256, G_D, SWA), 256)
    assert not v.same and "sliding_attention: " in v.verdict  # scaled as the global layers


@pytest.mark.parametrize(("name", "params", "match"), [
    ("yarn", {"factor": 4.0, "layer_types": ["sliding_attention", "full_attention"]},
     r"rotates gemma3's sliding-window layers at rope.freq_base_swa with no rope scaling .*sliding_attention \(yarn\)"
     r" cannot be expressed; patch full_attention only \(--layer-types full_attention\)"),
    ("linear", {"factor": 4.0, "layer_types": ["sliding_attention"]}, r"sliding_attention \(linear\) cannot"),
    ("yarn", {"factor": 4.0, "attention_factor": 1.3},
     r"multiplies every layer's cos/sin by rope.scaling.attn_factor, the sliding-window layers' too"),
    ("llama3", {"factor": 4.0}, r"rotates gemma3 with no frequency factors .*rope_freqs.weight would be ignored"),
])
def test_what_llama_cpp_cannot_express_on_gemma3_is_refused_in_one_line(name, params, match):
    with pytest.raises(ExportRefused, match=match) as err:
        gguf_rope(gemma3_patched(name, **params), 256)
    assert str(err.value).startswith("llama.cpp: ") and "\n" not in str(err.value)
    assert "llama-cpp-python 0.3.36" in str(err.value)


@pytest.mark.parametrize(("gguf_file", "match"), [
    ("llama", r"is a llama GGUF; the llama.cpp of llama-cpp-python 0.3.36 gives sliding-window layers their own "
              r"rope only in gemma3, gemma3n"),
    ("no-window", r"has no gemma3.attention.sliding_window, so .* rotates every layer as a global one"),
    ("other-swa-base", r"freq_base_swa 500 but the patched model's sliding layers' rope_theta is 10000"),
])
def test_a_gguf_that_would_not_apply_the_layer_types_is_refused_before_writing(gguf_file, match, tmp_path):
    src = tmp_path / f"{gguf_file}.gguf"
    if gguf_file == "llama":
        write_tiny_llama_gguf(src, tiny_llama_config(rope_theta=GLOBAL))
    else:
        config = tiny_gemma3_config()
        if gguf_file == "other-swa-base":
            config.rope_parameters["sliding_attention"]["rope_theta"] = 500.0
        write_tiny_gemma3_gguf(src, config, sliding_window=gguf_file != "no-window")
    out = tmp_path / "out" / "model.gguf"
    with pytest.raises(ExportRefused, match=match) as err:
        rewrite_gguf(src, out, gguf_rope(gemma3_patched("yarn", factor=4.0), 256))
    assert "\n" not in str(err.value)
    assert not out.parent.exists()
