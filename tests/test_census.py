"""The architecture census: every causal-LM type of the installed transformers, built tiny from its
config class, through every check of ``tests.census.checks`` (issue 27, item 1).

Each (type, check) must end ``exact``, ``refused: <one line>`` or ``n/a`` — never a crash, never
silently wrong logits, never a type the census cannot build. What fails today is listed, with its
cause, in ``tests.census.known.KNOWN`` and runs as a strict xfail: a fix turns it into an XPASS,
which fails until its entry is removed. A type that a new transformers release adds shows up here.

The table behind these tests is docs/architectures.md (``python -m tests.census.report``).
"""

import pytest

from tests.census.known import KNOWN
from tests.census.run import ALL_CHECKS, result, types

PASSING = ("exact", "refused", "n/a")


def _cases() -> list:
    cases = []
    for name in types():
        for check in ALL_CHECKS:
            reason = KNOWN.get(name, {}).get(check)
            # one worker computes a type's result (cached per process) and runs all its checks
            marks = [pytest.mark.xdist_group(name)]
            if reason:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            cases.append(pytest.param(name, check, marks=marks, id=f"{name}-{check}"))
    return cases


@pytest.mark.parametrize("name,check", _cases())
def test_census(name, check):
    outcome = result(name).outcomes[check]
    kind, _, why = outcome.partition(":")
    assert kind in PASSING, f"{name} {check}: {outcome}"
    if kind == "refused":
        assert why.strip() and "\n" not in why, f"{name} {check}: a refusal is one line naming why: {outcome!r}"


def test_known_names_real_types_and_checks():
    """A KNOWN entry for a type or check that does not exist would never run."""
    unknown = [(n, c) for n, checks in KNOWN.items() for c in checks if n not in types() or c not in ALL_CHECKS]
    assert not unknown, unknown


# --- the harness itself, against oracles it does not compute ------------------------------------

@pytest.mark.parametrize("name", ["smollm3", "llama4_text"])
def test_probe_finds_the_nope_layers_the_config_declares(name):
    """The probe reads nothing from the config; SmolLM3 and Llama 4 declare their NoPE layers in
    no_rope_layers (1: the layer applies RoPE), which the probe must find on its own."""
    import torch

    from tests.census.build import build, text_config, tiny_config
    from tests.census.checks import inputs
    from tests.census.probe import rotating_layers

    config = tiny_config(types()[name])
    declared = [bool(x) for x in text_config(config).no_rope_layers]
    assert not all(declared)  # the tiny model keeps a NoPE layer
    ids, other = inputs()
    found = rotating_layers(build(types()[name], config, dtype=torch.float32), ids[:, :24], other[:, :24])
    assert list(found.values()) == declared


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group(n), id=n) for n in types()])
def test_the_config_reader_reads_every_type_and_its_nope_layer_types_do_not_rotate(name):
    """ropescale's config-only reader (``rope_config_of``: what ``ropescale inspect`` and ``model_rope_config``
    read, no weights) on each type's tiny config, for every layer type it keys rope parameters by: d, θ and T,
    or a refusal in one line, never another exception. The layer types whose rope parameters are None (NoPE:
    Beam's, Ergo's full-attention layers) are layers the probe finds not rotating."""
    from ropescale.errors import RopescaleError
    from ropescale.rope_config import nope_layer_types, per_layer_type, rope_config_of
    from tests.census.build import text_config, tiny_config

    try:
        text = text_config(tiny_config(types()[name]))
    except Exception:  # noqa: BLE001 — a type the census cannot configure is reported by its build check
        return
    for lt in [None, *(per_layer_type(getattr(text, "rope_parameters", None)) or {})]:
        try:
            rope_config_of(text, lt)
        except RopescaleError as e:
            assert str(e).strip() and "\n" not in str(e).strip(), f"{name} {lt}: {e!r}"
    nope = nope_layer_types(text)
    if not nope or result(name).build != "built":
        return
    layers, per_layer = result(name).layers, list(text.layer_types)  # probed: R rotates, . does not
    assert len(layers) == len(per_layer), f"{name}: layers {layers} do not line up with layer_types {per_layer}"
    assert {r for r, lt in zip(layers, per_layer) if lt in nope} == {"."}, f"{name}: {layers}, {per_layer}"


def test_rotary_tables_are_told_from_masks_and_relative_tables():
    import torch

    from tests.census.probe import _kind, is_sin_cos

    angle = torch.arange(6.0)[:, None] * torch.tensor([1.0, 0.1])  # [s, d/2]
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)  # [s, d]
    assert is_sin_cos((cos, sin)) and is_sin_cos((2 * cos, 2 * sin))  # a constant attention scaling
    assert is_sin_cos(torch.cat([angle.sin(), angle.cos()], -1))  # RoFormer's [sin | cos] table
    assert is_sin_cos(torch.polar(torch.ones_like(angle), angle))  # freqs_cis
    assert not is_sin_cos((cos, cos)) and not is_sin_cos(torch.randn(6, 4))
    mask = torch.full((6, 6), torch.finfo(torch.float).min).triu(1)
    assert _kind(mask, 6) == "mask" and _kind(mask + torch.randn(6, 6), 6) == "bias"
    assert _kind((cos, sin), 6) == "sin/cos"
    relative = torch.cat([torch.arange(12.0)[:, None].sin(), torch.arange(12.0)[:, None].cos()], -1)  # 2s rows
    assert _kind(relative, 6) == "relative sin/cos"


def test_outcomes_are_classified_by_what_was_raised():
    from ropescale.errors import InvalidInput
    from tests.census.checks import classify

    assert classify(InvalidInput("window=0 must be >= 1")) == "refused: window=0 must be >= 1"
    assert classify(InvalidInput("two\nlines")).startswith("crash: InvalidInput: two")
    # a ValueError raised outside ropescale is no refusal
    assert classify(ValueError("from transformers")) == "crash: ValueError: from transformers"
    assert classify(RuntimeError("boom")) == "crash: RuntimeError: boom"


def test_indexers_select_fewer_keys_than_the_rule_window():
    """A sparse-attention indexer (DSA's index_topk, QSA's indexer_budget, MiniMax M3's index_topk_blocks of
    index_block_size keys, any *index*topk/budget size) must drop
    keys inside the relative rules' window, or the census cannot see a rule that ignores its selection."""
    from tests.census.build import _fields, text_config, tiny_config
    from tests.census.checks import WINDOW

    sizes = {}
    for name, t in types().items():
        try:
            f = _fields(text_config(tiny_config(t)))
        except Exception:  # noqa: BLE001 — a type the census cannot configure is reported by its build check
            continue
        sizes |= {(name, k): v * (f.get("index_block_size", 1) if "block" in k else 1) for k, v in f.items()
                  if "index" in k and ("topk" in k or "budget" in k) and isinstance(v, int)}  # [keys]
    # DSA's five types, QSA's two and MiniMax M3 in transformers 5.24; 5.25 adds Kolibri 1.1
    assert len({n for n, _ in sizes}) >= 8
    assert all(v < WINDOW for v in sizes.values()), {k: v for k, v in sizes.items() if v >= WINDOW}
