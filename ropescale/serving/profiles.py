"""Request-length profiles: one export per scale factor, and the rule that picks one per request.

Static scaling costs short prompts what it gives long ones (KL to the unscaled model grows with the
factor inside the training window: ``perplexity.kl``), so Qwen's documentation tells users to pick
the factor per deployment, and vLLM's request-static factor profiles (pull request #53964, open) would
pick it per request. Until an engine ships that, ``export_profiles`` writes one export per factor —
each served as the static strategy at that factor (the engines' parity holds for each) — and
``profiles.json`` with the rule; a router serves each request from the profile the rule names (one
engine per profile: ``docs/serving.md``, "Request-length profiles").

**Rule** (``select_profile``): a request of P prompt tokens asking for at most N new tokens goes to
the profile with the smallest factor s whose reach s·T covers P + N tokens (T: the training window);
past the largest reach, to the largest profile (whose engine, serving at most its reach, refuses
it). The sweep's ``profiles`` option scores a strategy this way (``ropescale.runs.config.StrategySpec``):
each example of a cell is L tokens, prompt and answer, so the rule picks one factor per cell.

Source: Peng et al. 2023, YaRN, arXiv:2309.00071 (static factor s, reach s·T); vLLM PR #53964.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ropescale.errors import InvalidInput, RopescaleError
from ropescale.runs.profiles import RULE, check_factors, factor_text, select_factor
from ropescale.strategies import get_strategy

__all__ = ["PROFILES_FILE", "Profile", "ProfilePlan", "check_factors", "export_profiles", "plan_profiles",
           "profile_folder", "read_profiles", "select_factor", "select_profile"]

PROFILES_FILE = "profiles.json"


@dataclass(frozen=True)
class Profile:
    """One export: its scale ``factor``, ``reach`` = ⌊factor · T⌋ [tokens] (its served length) and the
    folder (or GGUF file) ``path``, relative to the profiles folder."""

    factor: float
    reach: int
    path: str


def select_profile(profiles: list[Profile], prompt_tokens: int, max_new_tokens: int = 0) -> Profile:
    """The profile serving a request (the module's rule; ``InvalidInput`` for no profiles)."""
    if not profiles:
        raise InvalidInput("no profiles to choose from")
    ordered = sorted(profiles, key=lambda p: p.factor)
    tokens = prompt_tokens + max_new_tokens
    return next((p for p in ordered if p.reach >= tokens), ordered[-1])


def read_profiles(folder: str | Path) -> tuple[dict[str, Any], list[Profile]]:
    """``profiles.json`` of a folder ``export_profiles`` wrote: its record and the profiles.
    ``InvalidInput`` (one line) when it is missing or not such a file."""
    path = Path(folder) / PROFILES_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        profiles = [Profile(float(p["factor"]), int(p["reach"]), str(p["path"])) for p in record["profiles"]]
    except FileNotFoundError:
        raise InvalidInput(f"{path}: no such file (a folder `ropescale patch --profiles` wrote)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidInput(f"{path}: not a profiles file ({type(e).__name__}: {e})") from None
    return record, profiles


@dataclass(frozen=True)
class ProfilePlan:
    """One profile as ``plan_profiles`` checked it: its ``factor``, ``reach`` = ⌊factor · T⌋ [tokens] (T:
    ``train_length``), the ``folder`` it is written to (``profile_folder``) and the patch's per-layer
    ``layers`` (``PatchHandle.report``)."""

    factor: float
    reach: int
    train_length: int
    folder: str
    layers: list[dict[str, Any]]


def profile_folder(factor: float) -> str:
    """The folder of the profile of ``factor``: ``profile-<s>x`` with s written exactly
    (``ropescale.runs.profiles.factor_text``), so two factors never share a folder and the name reads
    back as its factor."""
    return f"profile-{factor_text(factor)}x"


def _check_request(model: nn.Module, strategy: str, factors: Any, params: dict[str, Any]) -> list[float]:
    """What needs no patch: the factors (``check_factors``), a static strategy with a factor, no ``factor``
    among ``params``, an unpatched model. Returns the factors, sorted."""
    from ropescale.patching import current_patch

    factors = check_factors(factors)
    strat = get_strategy(strategy)
    if strat.scale_param is None or strat.kind != "frequency" or strat.dynamic:
        raise InvalidInput(f"profiles: {strategy} has no static scale factor to pick per request (profiles serve "
                           "a static frequency strategy with a factor: yarn, linear, ntk, ...)")
    if strat.scale_param in params:
        raise InvalidInput(f"profiles: the factors come from the profiles; leave {strat.scale_param} out of the "
                           "strategy")
    if current_patch(model) is not None:
        raise InvalidInput("profiles: the model is already patched; give the unpatched model")
    return factors


def plan_profiles(model: nn.Module, strategy: str, factors: list[float], engine: str,
                  output: str | Path | None = None, *, gguf=None, patch_options: dict[str, Any] | None = None,
                  **params: Any) -> list[ProfilePlan]:
    """Every check ``export_profiles`` makes, for every factor, writing nothing: the *unpatched* ``model``
    is patched with ``strategy`` at each factor in turn (``patch_options``, ``params`` as there), its
    reach ⌊s · T⌋ checked as a served length and the patch translated for ``engine`` at it
    (``Engine.translate``: what the engine cannot express); with ``output``, each profile's folder
    checked writable (``check_export``; None: a dry run, no folder). The model is left unpatched.
    Returns the profiles, by factor. Raises what ``export_profiles`` raises, one line, before any write."""
    from ropescale.patching import patch
    from ropescale.serving.engines import get_engine
    from ropescale.serving.export import check_export
    from ropescale.serving.rope import check_length

    factors = _check_request(model, strategy, factors, params)
    scale = get_strategy(strategy).scale_param
    eng = get_engine(engine)
    if output is not None:
        check_export(eng.name, 2, output, gguf=gguf)
    plans = []
    for f in factors:
        with patch(model, strategy, **{scale: f}, **(patch_options or {}), **params) as handle:
            train = handle.context["original_max_position_embeddings"]
            if train is None:
                raise InvalidInput("profiles: the model's config has no training window; give "
                                   "original_max_position_embeddings")
            reach, folder = math.floor(f * train), profile_folder(f)
            try:
                if output is None:
                    length = check_length(reach)
                else:
                    length, _ = check_export(eng.name, reach, Path(output) / folder, gguf=gguf)
                eng.translate(handle, length)
            except RopescaleError as e:  # which profile, then the reason
                raise type(e)(f"profiles: ×{factor_text(f)} (serving {reach} tokens): {e}") from None
            plans.append(ProfilePlan(f, reach, train, folder, handle.report()))
    return plans


def export_profiles(model: nn.Module, strategy: str, factors: list[float], engine: str, output: str | Path, *,
                    tokenizer=None, gguf=None, patch_options: dict[str, Any] | None = None,
                    **params: Any) -> list[Any]:
    """Patch the *unpatched* ``model`` with ``strategy`` at each factor of ``factors`` in turn and export
    it for ``engine`` (``export_for``) to serve its reach ⌊s · T⌋ tokens, into ``output``/``profile-<s>x``
    (``profile_folder``: s written exactly); then write ``output``/``profiles.json`` (strategy, parameters,
    T, engine, the rule, each profile once). The model is left unpatched. Returns the ``ExportResult`` of
    each profile.

    ``params``: the strategy's other parameters (not ``factor``); ``patch_options``: ``patch``'s
    options (``original_max_position_embeddings``, ``layer_types``, ``temperature``, …).

    Raises ``InvalidInput`` (one line) for bad factors, a strategy without a ``factor`` parameter or a
    dynamic one (its factor follows the length: nothing to pick per request), ``factor`` among
    ``params``, a model already patched; ``export_for``'s errors for what the engine cannot express at
    any profile's reach — all before the first profile is written (``plan_profiles`` checks every factor
    first).
    """
    from ropescale.patching import patch
    from ropescale.serving.export import export_for
    from ropescale.serving.output import staged

    output, scale = Path(output), get_strategy(strategy).scale_param
    plans = plan_profiles(model, strategy, factors, engine, output, gguf=gguf, patch_options=patch_options, **params)
    results, rows = [], []
    for p in plans:
        with patch(model, strategy, **{scale: p.factor}, **(patch_options or {}), **params):
            result = export_for(model, engine, p.reach, output / p.folder, tokenizer=tokenizer, gguf=gguf)
        results.append(result)
        rows.append(asdict(Profile(p.factor, p.reach, str(result.path.relative_to(output)))) | {"usage": result.usage})
    record = {"strategy": strategy, "params": params, "patch_options": patch_options or {},
              "train_length": plans[0].train_length, "engine": results[0].engine, "rule": RULE,
              "profiles": rows}
    with staged(output, what=f"{output / PROFILES_FILE}") as stage:  # written whole or not at all
        (stage / PROFILES_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return results
