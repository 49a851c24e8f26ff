"""Ground truth from the model itself: which layers rotate, and what a layer does with identical inputs.

*Layers* are the elements of the outermost ``nn.ModuleList``s (decoder layers, Mamba and
linear-attention blocks alike; experts lists sit inside them and are not counted; towers a
text-only forward never calls record nothing). ``Recorder`` records every
call of every layer: positional and keyword inputs and the output.

Which layers rotate (``rotating_layers``): forwards with an all-ones attention mask (so
transformers never reads ``position_ids`` as packed sequences and every run has the same masks):

- A: ids at positions 0 … s−1;
- C: other ids at the same positions — an input of a layer call that differs between A and C
  carries content (hidden states, per-layer embeddings, cross-attention states), one that is
  equal carries only positions and masks (cos/sin, ``freqs_cis``, ``position_ids``, masks);
- B: A's ids at scrambled positions (5·p mod s, a permutation that changes every distance);
- D: A again, each layer fed (forward pre-hooks) A's inputs but for its rotary tables (cos/sin
  or ``freqs_cis``: ``is_sin_cos``), which come from B; where no table reaches any layer (the
  table lives inside the attention), B's inputs but for A's content.

A layer rotates when its output in D differs from A: with its content held fixed, the rotary
positions reaching it changed its output. Nothing is read from attribute names or config flags.

``SameInputs`` (the NoPE check) runs, inside a patched forward, each chosen layer a second time
on the very inputs it had in the unpatched forward, and keeps that output for a bit-for-bit
comparison; the patched forward itself runs on untouched.

Legend: s = sequence length [tokens].
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["Recorder", "SameInputs", "accepts_position_ids", "differs", "is_sin_cos", "layers_of", "max_abs_diff",
           "non_rope_why", "position_inputs", "rotating_layers"]


def layers_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of each layer: the elements of the outermost ModuleLists of composite modules."""
    out, taken = [], []
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or not len(m) or any(name.startswith(t + ".") for t in taken):
            continue
        if not all(any(True for _ in x.children()) for x in m):
            continue  # lists of plain Linear/Embedding modules (Gemma 3n's AltUp projections) are not layers
        taken.append(name)
        out += [(f"{name}.{i}", x) for i, x in enumerate(m)]
    return out


def _leaves(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _leaves(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _leaves(v)]
    if hasattr(x, "to_tuple"):  # ModelOutput
        return _leaves(x.to_tuple())
    return []


def differs(a, b) -> bool:
    """Whether two (nests of) tensors differ in any bit (shape, dtype or value)."""
    la, lb = _leaves(a), _leaves(b)
    return len(la) != len(lb) or any(x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y)
                                     for x, y in zip(la, lb))


def max_abs_diff(a, b) -> float:
    """max |a − b| over the leaves of two nests of tensors of equal shapes (inf when they are not)."""
    la, lb = _leaves(a), _leaves(b)
    if len(la) != len(lb) or any(x.shape != y.shape for x, y in zip(la, lb)):
        return float("inf")
    return max((float((x.double() - y.double()).abs().max()) for x, y in zip(la, lb) if x.numel()), default=0.0)


def _detach(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, tuple):
        return tuple(_detach(v) for v in x)
    if isinstance(x, list):
        return [_detach(v) for v in x]
    return x  # caches, configs, flags: kept as they are


class Recorder:
    """Records ``(args, kwargs, output)`` of every call of every layer while active; optionally
    replaces inputs first (``substitute(layer, call_index, args, kwargs) -> (args, kwargs)``)."""

    def __init__(self, layers: list[tuple[str, nn.Module]], substitute=None):
        self.layers, self.substitute = layers, substitute
        self.calls: dict[str, list[list[Any]]] = {n: [] for n, _ in layers}
        self._hooks: list = []

    def __enter__(self) -> Recorder:
        for name, m in self.layers:
            self._hooks.append(m.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._hooks.append(m.register_forward_hook(self._post(name), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _pre(self, name):
        def hook(module, args, kwargs):
            if self.substitute is not None:
                args, kwargs = self.substitute(name, len(self.calls[name]), args, kwargs)
            self.calls[name].append([_detach(args), {k: _detach(v) for k, v in kwargs.items()}, None])
            return args, kwargs
        return hook

    def _post(self, name):
        def hook(module, args, kwargs, output):
            self.calls[name][-1][2] = _detach(output)
        return hook


def is_sin_cos(x) -> bool:
    """Whether ``x`` is a rotary table: a ``(cos, sin)`` pair with cos² + sin² one constant
    (the attention scaling), a complex tensor of constant modulus (``freqs_cis``), or one tensor
    whose halves or even/odd entries are such a pair (RoFormer's ``[sin | cos]`` table)."""
    def const(a, b) -> bool:
        s = a.double() ** 2 + b.double() ** 2
        if a.numel() < 2 or not bool(torch.isfinite(s).all()) or float(s.min()) <= 0:
            return False
        constant = torch.allclose(s, s.flatten()[:1].expand_as(s), rtol=1e-4)
        return constant and not torch.equal(a, a.flatten()[:1].expand_as(a))  # a constant a is no table
    if isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(v, torch.Tensor) for v in x):
        a, b = x
        return a.shape == b.shape and a.is_floating_point() and const(a, b)
    if not isinstance(x, torch.Tensor):
        return False
    if x.is_complex():
        return const(x.real, x.imag)
    if not x.is_floating_point() or x.ndim < 1 or x.shape[-1] < 2 or x.shape[-1] % 2:
        return False
    h = x.shape[-1] // 2
    return const(x[..., :h], x[..., h:]) or const(x[..., 0::2], x[..., 1::2])


def _kind(x, s: int) -> str:
    """What a content-independent layer input is: ``sin/cos`` (a rotary table: one row per
    token — a relative table such as XLNet's has 2s rows), ``mask`` (bool, or 0 / large negative),
    ``bias`` (other floats: ALiBi), ``ints`` (position ids, buckets) or ``other``."""
    leaves = _leaves(x)
    if not leaves:
        return "other"
    if is_sin_cos(x if not isinstance(x, list) else tuple(x)):
        shape = leaves[0].shape
        return "sin/cos" if s in shape and max(shape) < 2 * s - 1 else "relative sin/cos"
    t = leaves[0]
    if t.dtype == torch.bool:
        return "mask"
    if t.is_floating_point():
        finite = t[torch.isfinite(t)]
        if not finite.numel() or bool(((finite == 0) | (finite <= torch.finfo(t.dtype).min / 2)).all()):
            return "mask"
        return "bias"
    return "mask" if bool(((t == 0) | (t == 1)).all()) else "ints"


def position_inputs(model: nn.Module, ids: torch.Tensor, other_ids: torch.Tensor) -> dict[str, str]:
    """Inputs reaching the layers that do not depend on the content (equal for ``ids`` and
    ``other_ids`` at the same positions): their names (``arg<i>`` or the keyword) → ``_kind``."""
    layers = layers_of(model)
    a, c = Recorder(layers), Recorder(layers)
    _run(model, ids, None, a)
    _run(model, other_ids, None, c)
    found: dict[str, str] = {}
    for name, calls in a.calls.items():
        if not calls or not c.calls[name]:
            continue
        (args, kw, _), (c_args, c_kw, _) = calls[0], c.calls[name][0]
        pairs = [(f"arg{j}", x, y) for j, (x, y) in enumerate(zip(args, c_args))]
        pairs += [(k, v, c_kw[k]) for k, v in kw.items() if k in c_kw]
        for key, x, y in pairs:
            if _leaves(x) and not differs(x, y) and key not in found:
                found[key] = _kind(x, ids.shape[1])
    return found


def non_rope_why(model: nn.Module, inputs: dict[str, str], max_positions: set[int]) -> str:
    """Why a type without RoPE has none, from what reaches its layers and its embedding tables."""
    kinds = set(inputs.values())
    learned = [m.weight.detach() for m in model.modules() if isinstance(m, nn.Embedding)
               and m.num_embeddings in max_positions]
    fixed = [b for m in model.modules() for b in m.buffers(recurse=False)
             if b.is_floating_point() and b.ndim == 2 and b.shape[0] in max_positions]
    if any(is_sin_cos(t[t.abs().sum(-1) > 0]) for t in learned + fixed):  # padding rows are zero
        return "sinusoidal absolute positions added to the embeddings"
    if learned:
        return "learned absolute positions added to the embeddings"
    if "ints" in kinds:
        return "no rotation: position ids reach the layers but change no layer's output with its input fixed " \
               "(NoPE attention, recurrent layers or relative buckets)"
    return "no position signal reaches the layers (recurrent / state-space layers or NoPE attention)"


def accepts_position_ids(model: nn.Module) -> bool:
    return "position_ids" in inspect.signature(model.forward).parameters


@torch.no_grad()
def _run(model, ids, positions, recorder: Recorder) -> None:
    kw = {"attention_mask": torch.ones_like(ids), "use_cache": False}
    if positions is not None:
        kw["position_ids"] = positions
    with recorder:
        model(input_ids=ids, **kw)


def _is_tensors(x) -> bool:
    return isinstance(x, torch.Tensor) or (isinstance(x, (tuple, list)) and bool(x)
                                            and all(isinstance(v, torch.Tensor) for v in x))


def _inputs(call) -> list[tuple[str, Any]]:
    args, kw, _ = call
    return [(f"arg{j}", x) for j, x in enumerate(args)] + list(kw.items())


def rotating_layers(model: nn.Module, ids: torch.Tensor, other_ids: torch.Tensor) -> dict[str, bool] | None:
    """Layer name → whether it rotates (see the module docstring), for the layers a text forward
    calls; None when the model's forward takes no ``position_ids`` (nothing to scramble).

    Where rotary tables (``is_sin_cos``) reach the layers, only they are taken from the scrambled
    run — a NoPE layer whose queries are scaled by position (Beam's full-attention layers) does
    not rotate; elsewhere (a table inside the attention, indexed by ``position_ids``) every input
    that does not carry content is.

    ``ids``, ``other_ids``: ``[1, s]`` token ids, differing everywhere."""
    if not accepts_position_ids(model):
        return None
    s = ids.shape[1]
    layers = layers_of(model)
    pos = torch.arange(s)[None]  # [1, s]
    scrambled = (pos * 5) % s if s % 5 else (pos * 7) % s  # a permutation: every distance changes
    a, c, b = Recorder(layers), Recorder(layers), Recorder(layers)
    _run(model, ids, pos, a)
    _run(model, other_ids, pos, c)
    _run(model, ids, scrambled, b)
    content, tables = {}, {}  # (layer, call) → input names carrying content / rotary tables
    for name, calls in a.calls.items():
        for i, call in enumerate(calls):
            if i < len(c.calls[name]):
                other = dict(_inputs(c.calls[name][i]))
                content[name, i] = {k for k, x in _inputs(call) if k in other and differs(x, other[k])}
                tables[name, i] = {k for k, x in _inputs(call) if k not in content[name, i] and is_sin_cos(x)}
    table_mode = any(tables.values())

    def substitute(name, i, args, kwargs):
        if (name, i) not in content or i >= len(b.calls[name]):
            return args, kwargs
        # tensors only: objects (a cache that the run filled) stay the current run's
        a_in = {k: v for k, v in _inputs(a.calls[name][i]) if _is_tensors(v)}
        b_in = {k: v for k, v in _inputs(b.calls[name][i]) if _is_tensors(v)}
        if table_mode:  # A's inputs, but for the rotary tables of the scrambled run
            take = {k: (b_in[k] if k in tables[name, i] and k in b_in else v) for k, v in a_in.items()}
        else:  # the scrambled run's inputs, but for A's content
            take = {k: (a_in[k] if k in content[name, i] and k in a_in else v) for k, v in b_in.items()}
        n = len(a.calls[name][i][0])
        return tuple(take.get(f"arg{j}", x) for j, x in enumerate(args[:n])) + args[n:], \
            {k: take.get(k, v) for k, v in kwargs.items()}

    d = Recorder(layers, substitute)
    _run(model, ids, pos, d)
    out = {}
    for name, _ in layers:
        if not a.calls[name]:
            continue  # not called by a text forward (a vision tower)
        out[name] = any(i >= len(d.calls[name]) or differs(call[2], d.calls[name][i][2])
                        for i, call in enumerate(a.calls[name]))
    return out


class SameInputs:
    """While active (in a patched forward), runs each layer of ``names`` again on the inputs it had
    in the recorded unpatched forward ``base`` and keeps the outputs in ``outputs[name]``."""

    def __init__(self, layers: list[tuple[str, nn.Module]], names: list[str], base: Recorder):
        self.layers = [(n, m) for n, m in layers if n in names]
        self.base = base
        self.outputs: dict[str, list[Any]] = {n: [] for n, _ in self.layers}
        self._hooks: list = []

    def __enter__(self) -> SameInputs:
        for name, m in self.layers:
            self._hooks.append(m.register_forward_hook(self._post(name, m)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _post(self, name, module):
        def hook(mod, args, output):
            i = len(self.outputs[name])
            if i < len(self.base.calls[name]):
                b_args, b_kw, _ = self.base.calls[name][i]
                with torch.no_grad():  # .forward: no hooks, so no recursion
                    self.outputs[name].append(_detach(module.forward(*_detach(b_args),
                                                                     **{k: _detach(v) for k, v in b_kw.items()})))
        return hook

    def worst(self) -> tuple[str, float] | None:
        """The layer whose output moved most from the unpatched one (name, max |Δ|), or None."""
        worst = None
        for name, outs in self.outputs.items():
            for i, out in enumerate(outs):
                base = self.base.calls[name][i][2]
                if differs(out, base):
                    d = max_abs_diff(out, base)
                    if worst is None or d > worst[1]:
                        worst = (name, d)
        return worst
