"""The census checks of one causal-LM type, each ending in one outcome.

Outcomes (strings): ``exact``; ``refused: <message>`` (ropescale raised its one-line
``RopescaleError``, or a one-line ``ValueError`` from inside ``ropescale/``); ``crash: <type>:
<first line>`` (anything else raised, or a refusal of more than one line); ``wrong: max|Δ| …``
(no error, logits off); ``n/a: <why>`` (nothing to compare with).

Checks (``CHECKS``), on the tiny model of the type (``build``) with its scaling stripped
(``unscaled``: rope types linear/dynamic/yarn/llama3/longrope → default, θ and partial rotary kept):

- ``vanilla``: ``patch(model, "vanilla")`` gives the logits bit for bit;
- ``unpatch``: after every patch below, ``unpatch`` restores the logits bit for bit — and a patch
  that raised left the model as it was;
- ``linear``, ``yarn``, ``dynamic_ntk``: the logits of the same weights built by transformers with
  the rope type in ``rope_parameters`` (every layer type where the config nests them; ropescale
  told the same ``layer_types``), ≤ ``TOL``;
- each relative rule (``RULES``): logits at positions below its window equal the unpatched ones
  (≤ ``TOL``) and move past it (by more than ``MOVES``);
- ``nope``: every layer that does not rotate (``probe.rotating_layers``: NoPE layers, Mamba and
  linear-attention blocks), run on the inputs it had unpatched, gives its unpatched output bit
  for bit under every patch above;
- ``native_vanilla``, ``native_shipped``: for a type that ships a scaled rope (its config class's
  default, or ``SHIPPED``): ``vanilla`` on the model as shipped equals the unscaled model (≤ TOL),
  and ropescale reproduces the model as shipped (≤ TOL) — with a ``native`` strategy once one is
  registered, until then with the strategy named like the shipped rope type and the shipped
  parameters.

Legend: s = ``LENGTH`` tokens, w = ``WINDOW`` tokens, L = the tiny config's max_position_embeddings.
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

import ropescale
from ropescale.errors import RopescaleError
from tests.census.build import MAX_POS, VOCAB, build, text_config, tiny_config
from tests.census.catalog import CausalLMType
from tests.census.probe import (
    Recorder,
    SameInputs,
    layers_of,
    max_abs_diff,
    non_rope_why,
    position_inputs,
    rotating_layers,
)

__all__ = ["CHECKS", "FREQUENCY", "RULES", "TypeResult", "run_type"]

LENGTH = 48  # s [tokens]: past L = 32, so dynamic scaling acts
PROBE_LENGTH = 24  # the rotation probe's length [tokens]: within every table of learned/sinusoidal positions
WINDOW = 8  # w [tokens]
TOL = 1e-5  # logits (float64 models), relative to the largest unpatched logit (at least 1)
MOVES = 1e-3  # a relative rule must move some logit past its window by more than this (relative, as TOL)

_WINDOW_L = {"original_max_position_embeddings": MAX_POS}
FREQUENCY = {  # ours: patch kwargs; theirs: transformers' rope_parameters
    "linear": ({"factor": 4.0}, {"rope_type": "linear", "factor": 4.0, **_WINDOW_L}),
    "yarn": ({"factor": 4.0}, {"rope_type": "yarn", "factor": 4.0, **_WINDOW_L}),
    "dynamic_ntk": ({"factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0, **_WINDOW_L}),
}
RULES = {  # every rule equals plain RoPE at distances below w (string: no cos/sin factor; dca: chunks of w)
    "rerope": {"window": WINDOW},
    "leaky_rerope": {"window": WINDOW, "k": 4.0},
    "self_extend": {"group_size": 4, "window": WINDOW},
    "string": {"shifted_offset": WINDOW, "local_window": 2, "attention_factor": 1.0},
    "dca": {"chunk_size": WINDOW + 4, "local_window": 4},
}
CHECKS = ("vanilla", "unpatch", *FREQUENCY, *RULES, "nope", "native_vanilla", "native_shipped")

SCALING = ("linear", "dynamic", "yarn", "llama3", "longrope")  # rope types that extend a trained window
SCALING_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "attention_factor", "truncate", "low_freq_factor", "high_freq_factor", "short_factor", "long_factor",
                "llama_4_scaling_beta", "max_position_embeddings", "type")

# scaled ropes the families ship where the config class's default is unscaled (hub config.json),
# as {layer type or None: rope parameters}; windows shrink to L
SHIPPED: dict[str, dict[str | None, dict[str, Any]]] = {
    # deepseek-ai/DeepSeek-V3 config.json
    "deepseek_v3": {None: {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": MAX_POS,
                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
    # deepseek-ai/DeepSeek-V2 config.json
    "deepseek_v2": {None: {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": MAX_POS,
                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}},
    # meta-llama/Llama-4-Scout-17B-16E config.json
    "llama4_text": {None: {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                           "original_max_position_embeddings": MAX_POS}},
    # google/gemma-3-4b-it: linear 8 on global layers
    "gemma3_text": {"full_attention": {"rope_type": "linear", "factor": 8.0}},
}
SHIPPED["llama4"] = SHIPPED["llama4_text"]
SHIPPED["gemma3"] = SHIPPED["gemma3_text"]
# Qwen/Qwen2.5-7B-Instruct-1M config.json: transformers does not implement it (vLLM does)
DUAL_CHUNK = {"qwen2": {"chunk_size": 262144, "local_size": 8192, "original_max_position_embeddings": 262144}}


def _one_line(msg: str) -> str:
    return msg.strip().splitlines()[0] if msg.strip() else ""


def _raised_in_ropescale(exc: BaseException) -> bool:
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and "/ropescale/" in frames[-1].filename.replace("\\", "/")


def classify(exc: BaseException) -> str:
    """``refused: …`` for a one-line RopescaleError (or ValueError raised in ropescale), else ``crash: …``."""
    msg = str(exc)
    one = "\n" not in msg.strip() and msg.strip()
    if one and (isinstance(exc, RopescaleError) or (isinstance(exc, ValueError) and _raised_in_ropescale(exc))):
        return f"refused: {msg.strip()}"
    return f"crash: {type(exc).__name__}: {_one_line(msg)[:300]}"


def _rope_dicts(rp: dict | None) -> dict[str | None, dict]:
    """rope_parameters as {layer type or None: its dict}."""
    if not rp:
        return {}
    if all(isinstance(v, dict) or v is None for v in rp.values()):
        return {k: v for k, v in rp.items() if isinstance(v, dict)}
    return {None: rp}


def _join(d: dict[str | None, dict], like: dict) -> dict:
    if None in d:
        return d[None]
    return {k: d.get(k, v) for k, v in like.items()}


def _rope_type(d: dict) -> str:
    return d.get("rope_type", d.get("type", "default"))


def _unscaled(d: dict) -> dict:
    """The rope parameters without scaling: rope type default, θ, partial rotary and layout kept.
    Ministral 3's attention reads llama_4_scaling_beta and the window whatever the rope type
    (modeling_ministral3.py, get_llama_4_attn_scale): beta 0 turns its query scaling off."""
    if _rope_type(d) not in SCALING:
        return d
    out = {k: v for k, v in d.items() if k not in SCALING_KEYS and k != "rope_type"} | {"rope_type": "default"}
    if "llama_4_scaling_beta" in d:
        out |= {"llama_4_scaling_beta": 0.0, "original_max_position_embeddings": MAX_POS}
    return out


def _with_rope(config, rope: dict[str | None, dict], parts: bool = False):
    """A deep copy of ``config`` whose text config's rope_parameters are ``rope`` (joined as nested).
    With ``parts``, the text config's sub-configs too (BLT's four stacks read their own): ``rope``'s
    keys over each one's own parameters."""
    cfg = copy.deepcopy(config)
    tc = text_config(cfg)
    tc.rope_parameters = _join(rope, tc.rope_parameters)
    if parts:
        over = {k: v for d in rope.values() for k, v in d.items() if k not in ("rope_theta", "partial_rotary_factor")}
        for sub in tc.__dict__.values():
            if isinstance(getattr(sub, "rope_parameters", None), dict) and None in _rope_dicts(sub.rope_parameters):
                sub.rope_parameters = {**sub.rope_parameters, **over}
    return cfg


@dataclass
class TypeResult:
    name: str
    model_class: str
    rope: list[str] = field(default_factory=list)  # evidence of RoPE; empty: no RoPE
    build: str = "built"  # or "not built: <why>"
    override: str = ""  # the per-family override's reason
    layers: str = ""  # rotation per layer: R rotates, . does not ("?" unknown)
    shipped: str = ""  # the scaled rope the family ships, in words
    outcomes: dict[str, str] = field(default_factory=dict)
    why: str = ""  # a type without RoPE: what it has instead
    seconds: float = 0.0


@torch.no_grad()
def _logits(model, ids) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, s]`` ids and ``[1, s]`` other ids (differing everywhere), below the special tokens."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB - 16, (1, LENGTH), generator=g)
    other = (ids + 1 + torch.randint(0, VOCAB - 18, (1, LENGTH), generator=g)) % (VOCAB - 16)
    return ids, other


def rope_evidence(config, model) -> list[str]:
    """Why the type counts as a RoPE type (rope parameters, rotary buffers, a module returning
    cos/sin or freqs_cis); the rotation probe adds its own."""
    ev = []
    if _rope_dicts(getattr(text_config(config), "rope_parameters", None)):
        ev.append("rope_parameters")
    if ropescale.find_rotary_modules(model):
        ev.append("inv_freq")
    return ev


def _fingerprint(model) -> tuple[list, list]:
    """What a patch could leave behind, compared without a forward: each module's class, forward, hook
    counts and plain attributes (a rotary module's attention_scaling) and the attention implementation;
    then every parameter and buffer (non-persistent ones too: inv_freq), copied."""
    meta = [getattr(model.config, "_attn_implementation", None)]
    for name, m in model.named_modules():
        plain = sorted((k, v) for k, v in vars(m).items()
                       if isinstance(v, (bool, int, float, str, type(None))) and not k.startswith("__"))
        forward = getattr(m.forward, "__func__", m.forward)
        meta.append((name, type(m), forward, len(m._forward_hooks), len(m._forward_pre_hooks), plain))
    tensors = [(n, t.detach().clone()) for n, t in [*model.named_parameters(), *model.named_buffers()]]
    return meta, tensors


def _same(a: tuple[list, list], b: tuple[list, list]) -> bool:
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(
        n == m and torch.equal(x, y) for (n, x), (m, y) in zip(a[1], b[1]))


class _Session:
    """One type's model, inputs and unpatched record; runs patches and keeps what they broke.

    After each patch: with ``exact_each``, a forward (the logits bit for bit); without, the model's
    ``_fingerprint`` — and one forward after the last patch (``restored``): a type whose model
    moved anywhere is run again with ``exact_each`` to name the patch that moved it."""

    def __init__(self, t: CausalLMType, config, model, length: int, exact_each: bool = False):
        self.t, self.config, self.model = t, config, model
        self.exact_each = exact_each
        self.state = {k: v.clone() for k, v in model.state_dict().items()}
        self.print = None if exact_each else _fingerprint(model)
        ids, other = inputs()
        self.ids, self.other = ids[:, :length], other[:, :length]
        self.layers = layers_of(model)
        self.base_rec = Recorder(self.layers)
        with self.base_rec:
            self.base = _logits(model, self.ids)
        self.still: list[str] = []  # layers that do not rotate
        self.nope: list[str] = []  # per patch: the non-rotating layer that moved most
        self.unpatch: list[str] = []  # per patch: what unpatch (or a raising patch) left changed
        self.ran = 0  # patched forwards that ran to the end (the NoPE check needs one)

    def patched(self, strategy: str, compare, **kw) -> str:
        """Patch, run, compare (``compare(logits) -> outcome``), unpatch; records NoPE-layer moves
        and what the model looks like afterwards."""
        try:
            handle = ropescale.patch(self.model, strategy, **kw)
        except Exception as exc:  # noqa: BLE001  (every failure is an outcome)
            self._after(strategy, "raised")
            return classify(exc)
        try:
            same = SameInputs(self.layers, self.still, self.base_rec)
            with same:
                got = _logits(self.model, self.ids)
            self.ran += 1
            worst = same.worst()
            if worst is not None:
                self.nope.append(f"{strategy}: {worst[0]} max|Δ| {worst[1]:.1e}")
            outcome = compare(got)
        except Exception as exc:  # noqa: BLE001
            outcome = classify(exc)
        try:
            handle.unpatch()
        except Exception as exc:  # noqa: BLE001
            self.unpatch.append(f"{strategy}: unpatch raised {classify(exc)}")
        self._after(strategy, "unpatched")
        return outcome

    def restored(self) -> bool:
        """Whether the model, after every patch, still gives the first logits bit for bit."""
        try:
            return torch.equal(_logits(self.model, self.ids), self.base)
        except Exception:  # noqa: BLE001  (the exact run names it)
            return False

    def _after(self, strategy: str, how: str) -> None:
        if not self.exact_each and _same(_fingerprint(self.model), self.print):
            return  # nothing left behind that a forward could see: restored() checks the end once
        if not self.exact_each:
            raise _Moved
        try:
            now = _logits(self.model, self.ids)
            moved = 0.0 if torch.equal(now, self.base) else max_abs_diff(now, self.base)
        except Exception as exc:  # noqa: BLE001
            self.unpatch.append(f"{strategy} ({how}): the forward then raised {classify(exc)}")
            moved = float("nan")
        else:
            if moved:
                self.unpatch.append(f"{strategy} ({how}): logits moved {moved:.1e}")
        if moved:  # go on with the same weights in a model no patch has touched
            self.model = build(self.t, self.config, self.state)
            self.layers = layers_of(self.model)


def _scale(ref: torch.Tensor) -> float:
    """The unit of TOL and MOVES: the largest |logit| of the reference, at least 1."""
    return max(1.0, float(ref.abs().max()))


def _close(ref: torch.Tensor):
    def compare(got: torch.Tensor) -> str:
        d = max_abs_diff(got, ref)
        return "exact" if d <= TOL * _scale(ref) else f"wrong: max|Δ| {d:.1e}"
    return compare


def _bitwise(ref: torch.Tensor):
    def compare(got: torch.Tensor) -> str:
        return "exact" if torch.equal(got, ref) else f"wrong: max|Δ| {max_abs_diff(got, ref):.1e}"
    return compare


def _window(ref: torch.Tensor, inside: int):
    def compare(got: torch.Tensor) -> str:
        near = max_abs_diff(got[:, :inside], ref[:, :inside])
        far = max_abs_diff(got[:, inside:], ref[:, inside:])
        if near > TOL * _scale(ref):
            return f"wrong: inside the window max|Δ| {near:.1e}"
        if far <= MOVES * _scale(ref):
            return f"wrong: logits past the window move only {far:.1e}"
        return "exact"
    return compare


def _native(s: _Session, rope: dict[str | None, dict]) -> tuple[torch.Tensor | None, str]:
    """Logits of the session's weights built by transformers with ``rope``; or None and why not."""
    try:
        cfg = _with_rope(s.config, rope, parts=True)
        model = build(s.t, cfg, s.state)
        return _logits(model, s.ids), ""
    except Exception as exc:  # noqa: BLE001
        return None, f"transformers cannot build it: {type(exc).__name__}: {_one_line(str(exc))[:200]}"


def _native_rope(d: dict, name: str, theirs: dict) -> dict | None:
    """transformers' rope parameters for strategy ``name`` on a layer whose own are ``d``; None
    when transformers has no such variant (proportional RoPE has ``factor``, i.e. linear, only)."""
    kind = _rope_type(d)
    if kind == "default":
        return {**d, **theirs}
    if kind == "proportional" and name == "linear":
        return {**d, "factor": theirs["factor"]}
    return None


def _frequency_checks(s: _Session, base_rope: dict[str | None, dict], out: dict[str, str]) -> None:
    nested = None not in base_rope
    for name, (ours, theirs) in FREQUENCY.items():
        native = {k: _native_rope(d, name, theirs) for k, d in base_rope.items()}
        missing = sorted({_rope_type(base_rope[k]) for k, v in native.items() if v is None})
        if missing:
            out[name] = f"n/a: transformers has no {theirs['rope_type']} variant of rope type {'/'.join(missing)}"
            continue
        ref, why = _native(s, native)
        if ref is None:
            out[name] = f"n/a: {why}"
            continue
        used = getattr(text_config(s.config), "layer_types", None) or list(base_rope)
        kw = {"layer_types": [k for k in base_rope if k in used]} if nested else {}
        out[name] = s.patched(name, _close(ref), **ours, **kw)


def _shipped_checks(s: _Session, base_rope, shipped: dict[str | None, dict], out: dict[str, str]) -> None:
    try:
        cfg = _with_rope(s.config, {k: {**base_rope.get(k, {}), **d} for k, d in shipped.items()}
                         if None not in base_rope or None in shipped else shipped)
        model = build(s.t, cfg, s.state)
        ref = _logits(model, s.ids)
    except Exception as exc:  # noqa: BLE001
        why = f"transformers cannot build the shipped config: {type(exc).__name__}: {_one_line(str(exc))[:200]}"
        out["native_vanilla"] = out["native_shipped"] = f"n/a: {why}"
        return
    try:
        with ropescale.patch(model, "vanilla"):
            got = _logits(model, s.ids)
        out["native_vanilla"] = _close(s.base)(got)
    except Exception as exc:  # noqa: BLE001
        out["native_vanilla"] = classify(exc)
    (lt, d), = [(k, v) for k, v in shipped.items()][:1]
    rope_type = _rope_type(d)
    strategy = "native" if "native" in ropescale.strategy_names() else \
        {"dynamic": "dynamic_ntk"}.get(rope_type, rope_type)
    if strategy not in ropescale.strategy_names():
        out["native_shipped"] = f"n/a: no ropescale strategy reproduces rope type {rope_type} yet (no `native`)"
        return
    kw: dict[str, Any] = {}
    if strategy != "native":
        kw = {k: v for k, v in d.items() if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor",
                                                      "original_max_position_embeddings", "max_position_embeddings")}
        if "original_max_position_embeddings" in d:
            kw["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        if lt is not None:
            kw["layer_types"] = [lt]
    try:
        with ropescale.patch(model, strategy, **kw):
            got = _logits(model, s.ids)
        out["native_shipped"] = _close(ref)(got)
    except Exception as exc:  # noqa: BLE001
        out["native_shipped"] = classify(exc)


def _shipped_of(name: str, default_rope: dict[str | None, dict]) -> dict[str | None, dict] | None:
    if name in SHIPPED:
        return SHIPPED[name]
    scaled = {k: d for k, d in default_rope.items() if _rope_type(d) in SCALING}
    if not scaled:
        return None
    small = {}
    for k, d in scaled.items():
        d = {**d}
        for key in ("original_max_position_embeddings", "max_position_embeddings"):
            if key in d:
                d[key] = MAX_POS  # the shipped window, shrunk with the model
        small[k] = d
    return small


class _Moved(Exception):
    """The fast path saw a patch leave the model changed: run the type with a forward after each patch."""


def run_type(t: CausalLMType, exact_each: bool = False) -> TypeResult:
    """Every check of type ``t`` (see the module docstring)."""
    if exact_each:
        return _run_type(t, True)
    try:
        return _run_type(t, False)
    except _Moved:
        return _run_type(t, True)


def _run_type(t: CausalLMType, exact_each: bool) -> TypeResult:
    import time

    from tests.census.build import OVERRIDES

    start = time.perf_counter()
    res = TypeResult(t.name, t.model_class_name, override=OVERRIDES[t.name].why if t.name in OVERRIDES else "")
    try:
        config = tiny_config(t)
        default_rope = _rope_dicts(getattr(text_config(config), "rope_parameters", None))
        base_rope = {k: _unscaled(d) for k, d in default_rope.items()}
        unscaled = _with_rope(config, base_rope) if default_rope else config
        model = build(t, unscaled, dtype=torch.float32)  # float64 only for RoPE types (below)
        ids, other = inputs()
        res.rope = rope_evidence(unscaled, model)
        short, short_other = ids[:, :PROBE_LENGTH], other[:, :PROBE_LENGTH]
        reaching = position_inputs(model, short, short_other)
        tables = [k for k, v in reaching.items() if v == "sin/cos"]
        if tables:
            res.rope.append(f"cos/sin reach the layers ({', '.join(tables)})")
        rot = rotating_layers(model, short, short_other)
        if rot is not None and any(rot.values()):
            res.rope.append("layers rotate with position_ids")
        s = _Session(t, unscaled, model.double() if res.rope else model, LENGTH if res.rope else PROBE_LENGTH,
                     exact_each)
    except Exception as exc:  # noqa: BLE001
        res.build = f"not built: {type(exc).__name__}: {_one_line(str(exc))[:200]}"
        res.seconds = time.perf_counter() - start
        return res
    if rot is not None and not any(rot.values()) and {"rope_parameters", "inv_freq"} & set(res.rope):
        res.layers = "? (RoPE declared, yet scrambled position_ids move no layer: positions taken elsewhere)"
        rot = None
    elif rot is None:
        res.layers = "? (the forward takes no position_ids)"
    else:
        res.layers = "".join("R" if v else "." for v in rot.values())
        s.still = [n for n, v in rot.items() if not v]
    if not res.rope:  # a non-RoPE type: patching must be refused in one line
        tc = text_config(unscaled)
        sizes = {getattr(tc, k, None) for k in ("max_position_embeddings", "n_positions", "max_target_positions")}
        res.why = non_rope_why(model, reaching, {n + k for n in sizes if isinstance(n, int) for k in (0, 1, 2)})
        res.outcomes = {"vanilla": s.patched("vanilla", _bitwise(s.base))}
        if not exact_each and not s.restored():
            raise _Moved
        res.seconds = time.perf_counter() - start
        return res
    out = res.outcomes
    out["vanilla"] = s.patched("vanilla", _bitwise(s.base))
    _frequency_checks(s, base_rope, out)
    for name, params in RULES.items():
        out[name] = s.patched(name, _window(s.base, WINDOW), **params)
    if not exact_each and not s.restored():
        raise _Moved
    out["unpatch"] = "exact" if not s.unpatch else "wrong: " + "; ".join(s.unpatch)
    if rot is None:
        out["nope"] = f"n/a: which layers rotate is unknown: {res.layers[3:-1]}"
    elif not s.still:
        out["nope"] = "n/a: every layer rotates"
    elif not s.ran:
        out["nope"] = "n/a: no patched forward ran to the end"
    else:
        out["nope"] = "exact" if not s.nope else "wrong: " + "; ".join(s.nope)
    shipped = _shipped_of(t.name, default_rope)
    if t.name in DUAL_CHUNK:
        res.shipped = f"dual_chunk_attention_config {DUAL_CHUNK[t.name]}"
        out["native_vanilla"] = out["native_shipped"] = (
            "n/a: transformers ignores dual_chunk_attention_config (Qwen2.5-1M; vLLM implements it)")
    elif shipped is None:
        out["native_vanilla"] = out["native_shipped"] = "n/a: ships no scaled rope"
    else:
        res.shipped = "; ".join(f"{k or 'all layers'}: {d}" for k, d in shipped.items())
        _shipped_checks(s, base_rope, shipped, out)
    res.outcomes = {c: out[c] for c in CHECKS if c in out}
    res.seconds = time.perf_counter() - start
    return res
