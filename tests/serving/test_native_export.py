"""`patch --strategy native`: the model's own rope parameters exported (issue 41).

The oracle is plain transformers itself: a folder saved with each shipped scaling the census meets —
by ``save_pretrained`` as a hub checkpoint ships it, or by a ropescale export of that scaling (the issue's
``y4``) — is exported with ``native``; ``AutoModelForCausalLM.from_pretrained`` of the export must give
the logits of ``from_pretrained`` of the folder it came from, bit for bit, within and past the window
(dynamic and LongRoPE switch there) and with ``max_position_embeddings`` raised for a served length.
For the engines serving one static rotation, what each computes from the export is compared with the
source model's own rotary module (transformers' code), or the export is refused in one line.
"""

import copy

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

import ropescale
from cli import main
from ropescale.models import REFERENCE_MODEL
from ropescale.serving import ExportRefused, compare, get_engine
from ropescale.serving.rope import EngineRope, compare_layers
from tests.census.build import build as census_build
from tests.census.build import text_config, tiny_config
from tests.census.catalog import CausalLMType
from tests.conftest import tiny_llama_config
from tests.families import family_config

W = 32  # the census's tiny window (max_position_embeddings) [tokens]
SERVE = 256  # the served length: past every window, so max_position_embeddings is rewritten [tokens]
IDS = torch.randint(3, 120, (1, 80), generator=torch.Generator().manual_seed(41))  # past every window
SHORT_IDS = IDS[:, :12]  # within every window (LongRoPE's short factors, dynamic unscaled)
N = 8  # rotary pairs of the tiny Llama (head_dim 16)

# name: (family, {layer type or None: rope parameters as the checkpoint ships them}); census windows shrunk to W
SHIPPED = {
    "linear": ("llama", {None: {"rope_type": "linear", "factor": 4.0}}),
    "dynamic": ("llama", {None: {"rope_type": "dynamic", "factor": 2.0}}),
    "yarn": ("llama", {None: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
    # openai/gpt-oss-20b: unrounded ramp
    "yarn_gpt_oss": ("gpt_oss", {None: {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "truncate": False, "original_max_position_embeddings": W,
                                        "rope_theta": 150000.0}}),
    # deepseek-ai/DeepSeek-V3: mscale / mscale_all_dim (its attention squares the latter into the softmax scale)
    "yarn_deepseek_v3": ("deepseek_v3", {None: {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                "original_max_position_embeddings": W}}),
    # mistralai/Ministral-3: YaRN plus the query temperature its attention reads from the rope parameters
    "yarn_ministral3": ("ministral3", {None: {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                              "original_max_position_embeddings": W, "beta_fast": 32.0,
                                              "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                              "llama_4_scaling_beta": 0.1}}),
    # meta-llama/Llama-3.1-8B (windows shrunk)
    "llama3": ("llama", {None: {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16}}),
    # meta-llama/Llama-4-Scout: low_freq_factor = high_freq_factor (no smooth band; ropescale's llama3 writes it
    # too, which it refused once)
    "llama3_llama4": ("llama4_text", {None: {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 1.0, "original_max_position_embeddings": W}}),
    "longrope": ("llama", {None: {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16,
                                  "short_factor": [1.0 + 0.05 * i for i in range(N)],
                                  "long_factor": [1.0 + 0.5 * i for i in range(N)]}}),
    # microsoft/Phi-3.5-mini-instruct: no factor (mpe / T), the window at the config's top level
    "longrope_phi3": ("phi3", {None: {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(4)],
                                      "long_factor": [1.0 + 0.5 * i for i in range(4)]}}),
    # google/gemma-3-4b-it: linear x8 on the global layers only
    "linear_gemma3": ("gemma3_text", {"full_attention": {"rope_type": "linear", "factor": 8.0}}),
}
# the scalings ropescale can write itself: their folders saved by `ropescale patch` as well (the y4)
BY_ROPESCALE = ["linear", "dynamic", "yarn", "yarn_gpt_oss", "llama3", "llama3_llama4", "longrope",
                "linear_gemma3"]


CENSUS = {"gpt_oss": "GptOssForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
          "ministral3": "Ministral3ForCausalLM", "llama4_text": "Llama4ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def _config(family: str, rope: dict):
    """The tiny config of ``family`` with ``rope`` as its rope parameters (per layer type where keyed)."""
    if family == "llama":
        config = tiny_llama_config()
    elif family == "phi3":
        config = family_config("phi3")
    else:
        config = tiny_config(CausalLMType(family, CENSUS[family]))
    config = copy.deepcopy(config)
    text = text_config(config)
    own = text.rope_parameters
    if None in rope:
        text.rope_parameters = {"rope_theta": own.get("rope_theta", 10000.0), **rope[None]}
    else:
        text.rope_parameters = {k: {**v, **rope.get(k, {})} for k, v in own.items()}
    return config


def _model(family: str, rope: dict):
    """The tiny random model of ``family`` (seeded, float32, eval mode) with ``rope``."""
    config = _config(family, rope)
    if family in CENSUS:
        return census_build(CausalLMType(family, CENSUS[family]), config, dtype=torch.float32)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Models of a few thousand weights: a second intra-op thread only spins on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REFERENCE_MODEL)


@pytest.fixture
def run():
    runner = CliRunner()
    return lambda *args: runner.invoke(main, [str(a) for a in args], catch_exceptions=False)


def _ropescale_spec(rope: dict) -> tuple[str, dict]:
    """The ropescale strategy and patch arguments that write ``rope`` (one patched layer type)."""
    (layer_type, d), = rope.items()
    name = {"dynamic": "dynamic_ntk"}.get(d["rope_type"], d["rope_type"])
    kw = {k: v for k, v in d.items() if k not in ("rope_type", "rope_theta", "partial_rotary_factor")}
    return name, kw | ({"layer_types": [layer_type]} if layer_type else {})


def _source(path, case: str, saved_by: str, tokenizer):
    """The folder a user starts from: ``case`` saved as a checkpoint ships it, or the unscaled model with
    the scaling patched and exported by ropescale."""
    family, rope = SHIPPED[case]
    if saved_by == "transformers":
        _model(family, rope).save_pretrained(path)
        tokenizer.save_pretrained(path)
        return path
    base = path.parent / "unscaled"
    _model(family, {k: {"rope_type": "default"} for k in rope}).save_pretrained(base)
    tokenizer.save_pretrained(base)
    model, tok = ropescale.load_model(str(base), device="cpu")
    name, kw = _ropescale_spec(rope)
    ropescale.patch(model, name, **kw)
    result = ropescale.export_for(model, "transformers", None, path, tokenizer=tok)
    assert result.usage.startswith("plain transformers (AutoModelForCausalLM.from_pretrained) reproduces it")
    return path


@torch.no_grad()
def _plain_logits(folder) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return [model(ids).logits for ids in (SHORT_IDS, IDS)]


CASES = [(c, "transformers") for c in SHIPPED] + [(c, "ropescale") for c in BY_ROPESCALE]


@pytest.mark.parametrize("case,saved_by", CASES, ids=[f"{c}-{s}" for c, s in CASES])
def test_native_export_reloads_bit_identical_to_its_source(tmp_path, tokenizer, run, case, saved_by):
    src = _source(tmp_path / "src", case, saved_by, tokenizer)
    out = tmp_path / "native"
    res = run("patch", "--model", src, "--strategy", "native", "--engine", "transformers", "--serve-length", SERVE,
              "-o", out, "-q")
    assert res.exit_code == 0, res.output
    assert "plain transformers (AutoModelForCausalLM.from_pretrained) reproduces it" in res.output
    assert "checked: plain from_pretrained of the folder gives the patched model's logits" in res.output
    for got, expected in zip(_plain_logits(out), _plain_logits(src)):
        assert torch.equal(got, expected)


# what the static engines cannot express of the model's own rope, one line each
REFUSED = {
    ("dynamic", "vllm"): "vLLM: the model's own rope type 'dynamic' recomputes its base",
    ("dynamic", "llama.cpp"): "llama.cpp: the model's own rope type 'dynamic' recomputes its base",
    ("yarn_gpt_oss", "llama.cpp"): "llama.cpp: its YaRN ramp always floors/ceils",
}
ENGINE_CASES = ["linear", "dynamic", "yarn", "yarn_gpt_oss", "llama3", "llama3_llama4", "longrope", "longrope_phi3",
                "linear_gemma3"]
L = 64  # within every case's ⌈T·s⌉ (vLLM's YaRN cache) and past every window [tokens]


@torch.no_grad()
def _transformers_rope(model, length: int) -> EngineRope | dict[str, EngineRope]:
    """What the source model's own rotary module (transformers' code) rotates by at ``length``: its
    buffers after a forward over positions 0 … length−1 (dynamic and LongRoPE update there); per
    layer type for a per-layer-type module (Gemma 3)."""
    rotary = model.model.rotary_emb
    if hasattr(rotary, "inv_freq"):
        rotary(torch.zeros(1, length, 1), torch.arange(length)[None])
        return EngineRope(rotary.inv_freq.double(), float(rotary.attention_scaling), 1.0, "transformers")
    return {lt: EngineRope(getattr(rotary, f"{lt}_inv_freq").double(),
                           float(getattr(rotary, f"{lt}_attention_scaling")), 1.0, "transformers")
            for lt in ("full_attention", "sliding_attention")}


@pytest.mark.parametrize("engine", ["vllm", "llama.cpp"])
@pytest.mark.parametrize("case", ENGINE_CASES)
def test_native_for_static_engines_serves_the_models_own_rotation_or_refuses(case, engine):
    family, rope = SHIPPED[case]
    source = _model(family, rope)
    model = copy.deepcopy(source)
    handle = ropescale.patch(model, "native")
    eng = get_engine(engine)
    try:
        translation = eng.translate(handle, L)
    except ExportRefused as e:
        assert (case, engine) in REFUSED, str(e)
        assert str(e).startswith(REFUSED[case, engine]) and "\n" not in str(e)
        return
    assert (case, engine) not in REFUSED
    ours, theirs = _transformers_rope(source, L), eng.rope(translation, L, handle.context)
    verdict = compare_layers(ours, theirs, L) if isinstance(ours, dict) else compare(ours, theirs, L)
    assert verdict.same, verdict.verdict
