"""Export a patched model's rotation into a GGUF for llama.cpp, and llama.cpp's formulas re-implemented.

``gguf_rope`` translates the patch (through its transformers rope type, ``ropescale.serving.plan``)
into llama.cpp's ``{arch}.rope.*`` metadata and rope tensors; ``rewrite_gguf`` writes them into a
copy of an existing GGUF (llama.cpp's converter output, say), every other key and tensor copied
unchanged through the ``gguf`` package (llama.cpp's own gguf-py; ``pip install 'ropescale[gguf]'``).

What each transformers rope type becomes (llama architecture):

=========  ===================================================================================
default    ``rope.freq_base`` = b (vanilla), b·s^(d/(d−2)) (NTK), or the frozen dynamic NTK base
linear     ``rope.scaling.type = linear``, ``rope.scaling.factor`` = s
yarn       ``type = yarn``, ``factor`` = s, ``original_context_length`` = T, and
           ``rope.scaling.attn_factor`` = A/(0.1·ln s + 1) — llama.cpp overwrites the runtime
           ``yarn_attn_factor`` with 1 and multiplies the GGUF key in; non-default betas refused
           (the llama architecture never reads ``rope.scaling.yarn_beta_*``)
llama3     ``type = none`` and the ``rope_freqs`` tensor: per-pair divisors from the model's real
           window T (llama.cpp's converter reads it from a top-level key defaulting to 8192)
longrope   ``type = none``, ``rope_freqs`` = the long (L > T) or short factors, chosen once for
           the served length, and ``attn_factor`` = the attention factor
=========  ===================================================================================

Dynamic NTK is refused unless frozen (``freeze_dynamic_at``): llama.cpp has no dynamic rope and the
converter drops it silently (the GGUF then runs vanilla RoPE).

``llama_cpp_rope`` re-implements llama.cpp's runtime rope for a GGUF's metadata: hparams in
``src/llama-model.cpp`` (``load_hparams``: ``rope.scaling.type`` defaults to ``linear``,
``rope_freq_scale_train`` = 1/``rope.scaling.factor``, ``rope.scaling.attn_factor``), cparams in
``src/llama-context.cpp`` (``yarn_ext_factor`` 1 for YaRN else 0; ``yarn_attn_factor`` overwritten
with get_mscale(s)/(1 + 0.1·ln s) then times ``rope.scaling.attn_factor``, PR #17945),
``llama_model::get_rope_factors`` (``rope_freqs``, else long/short factors by context size), and
ggml's ``ggml_rope_yarn_corr_dims``/``rope_yarn_ramp``/``rope_yarn``/``rope_cache_init``
(``ggml/src/ggml-cpu/ops.cpp``, ``ggml/src/ggml.c``), all in float32 as llama.cpp computes them —
as read in the llama.cpp vendored by the llama-cpp-python 0.3.36 sdist (ggml 0.25.3, libllama
0.5.0; the llama architecture's tensors in ``src/models/llama.cpp``). End to end on the bundled
model, real llama.cpp on GGUFs this module wrote matched ropescale's log-probabilities within
2.4e-4 at 4T and 8T for every exported strategy.

Notation: b = ``rope_theta``, d = rotary dim (``n_rot``), T = training window, s = ``factor``,
A = attention factor (cos/sin magnitude), L = served length (``n_ctx``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ropescale.errors import InvalidInput, RopescaleError
from ropescale.serving.output import same_path, staged
from ropescale.serving.plan import served_rope_parameters
from ropescale.serving.rope import EngineRope, ExportRefused, check_length, patch_handle

__all__ = ["ENGINE", "ROPE_KEYS", "ROPE_TENSORS", "GgufRope", "GgufUnavailable", "gguf_rope", "llama_cpp_rope",
           "read_gguf_rope", "rewrite_gguf"]

ENGINE = "llama.cpp"
# the metadata that decides llama.cpp's rotation: replaced as a whole by rewrite_gguf
ROPE_KEYS = ("rope.freq_base", "rope.scale_linear", "rope.scaling.type", "rope.scaling.factor",
             "rope.scaling.attn_factor", "rope.scaling.original_context_length", "rope.scaling.yarn_log_multiplier",
             "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_beta_fast",
             "rope.scaling.yarn_beta_slow")
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_LONGROPE_ARCHS = ("phi3", "phimoe")  # architectures whose graph loads rope_factors_long/short
_DEFAULT_BETAS = (32.0, 1.0)


class GgufUnavailable(RopescaleError, ImportError):
    """The optional ``gguf`` package is not installed."""


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GgufUnavailable("writing GGUF files needs the gguf package: pip install 'ropescale[gguf]'") from None
    return gguf


@dataclass
class GgufRope:
    """The rope metadata and tensors of a GGUF for one served length.

    arch: ``general.architecture`` the keys are written for; kv: full key
    (``{arch}.rope.…``) → ``(value, gguf.GGUFValueType)``; tensors: name (``rope_freqs.weight`` …)
    → float32 ``[d/2]`` array; notes: what the export decided and why.
    """

    arch: str
    kv: dict[str, tuple[Any, Any]]
    tensors: dict[str, np.ndarray]
    notes: list[str] = field(default_factory=list)
    dim: int | None = None  # the model's rotary dim d (None: not checked against the GGUF)
    base: float | None = None  # the model's rope_theta b, unpatched (None: not checked)
    rope_type: str | None = None  # the transformers rope type translated

    def for_arch(self, arch: str) -> GgufRope:
        """The same metadata keyed for another architecture."""
        old = f"{self.arch}."
        kv = {f"{arch}.{k[len(old):]}" if k.startswith(old) else k: v for k, v in self.kv.items()}
        return GgufRope(arch, kv, dict(self.tensors), list(self.notes), self.dim, self.base, self.rope_type)


def gguf_rope(model_or_handle, serve_length: int, *, freeze_dynamic_at: int | None = None,
              arch: str = "llama") -> GgufRope:
    """The GGUF rope metadata that makes llama.cpp rotate as the patched model does at ``serve_length``.

    See the module docstring for the table. Raises ``ExportRefused`` ("llama.cpp: ...", one line)
    for relative rules (ReRoPE, Leaky ReRoPE, SelfExtend, DCA, STRING), log-n, ``dynamic_block``,
    strategies without a transformers export hook, non-default YaRN betas, dynamic NTK
    without ``freeze_dynamic_at``, and ``rope_freqs`` (llama3, longrope) for an ``arch`` that loads
    ``rope_factors_long/short`` instead (phi3, phimoe); ``InvalidInput`` for an unpatched model or bad lengths;
    ``GgufUnavailable`` without the ``gguf`` package.
    """
    gguf = _gguf()
    t_ = gguf.GGUFValueType
    handle = patch_handle(model_or_handle)
    served = served_rope_parameters(handle, ENGINE, serve_length, freeze_dynamic_at=freeze_dynamic_at,
                                    freeze_default=False)
    rp, ctx, length = served.rope_parameters, served.context, served.serve_length
    d, t = ctx["dim"], ctx["original_max_position_embeddings"]
    kind = rp["rope_type"]
    k = f"{arch}.rope."
    kv: dict[str, tuple[Any, Any]] = {k + "freq_base": (float(rp["rope_theta"]), t_.FLOAT32)}
    tensors: dict[str, np.ndarray] = {}
    notes = list(served.notes)
    if kind == "default":
        kv[k + "scaling.type"] = ("none", t_.STRING)
    elif kind == "linear":
        kv[k + "scaling.type"] = ("linear", t_.STRING)
        kv[k + "scaling.factor"] = (float(rp["factor"]), t_.FLOAT32)
    elif kind == "yarn":
        betas = (float(rp["beta_fast"]), float(rp["beta_slow"]))
        if betas != _DEFAULT_BETAS:
            raise ExportRefused(f"llama.cpp: the llama architecture never reads rope.scaling.yarn_beta_*, so "
                                f"beta_fast={betas[0]:g}/beta_slow={betas[1]:g} would run as 32/1; export betas 32/1 "
                                f"or serve with --yarn-beta-fast {betas[0]:g} --yarn-beta-slow {betas[1]:g}")
        if rp.get("truncate", True) is False:
            raise ExportRefused("llama.cpp: its YaRN ramp always floors/ceils the correction dims (truncate: true); "
                                "an unrounded ramp (truncate: false) cannot be expressed")
        s, a = float(rp["factor"]), float(rp["attention_factor"])
        kv[k + "scaling.type"] = ("yarn", t_.STRING)
        kv[k + "scaling.factor"] = (s, t_.FLOAT32)
        kv[k + "scaling.original_context_length"] = (int(rp["original_max_position_embeddings"]), t_.UINT32)
        kv[k + "scaling.attn_factor"] = (a / (0.1 * math.log(s) + 1.0) if s > 1 else a, t_.FLOAT32)
        notes.append(f"yarn: rope.scaling.attn_factor = A/(0.1·ln s + 1) carries attention_factor {a:g} "
                     "(llama.cpp overwrites the runtime yarn_attn_factor)")
    elif kind == "llama3":
        kv[k + "scaling.type"] = ("none", t_.STRING)
        tensors["rope_freqs.weight"] = _llama3_divisors(rp, d)
        notes.append(f"llama3: rope_freqs divisors from the model's window {rp['original_max_position_embeddings']} "
                     "(llama.cpp's converter would read a top-level key defaulting to 8192)")
    elif kind == "longrope":
        long = length > t
        factors = rp["long_factor" if long else "short_factor"]
        kv[k + "scaling.type"] = ("none", t_.STRING)
        kv[k + "scaling.attn_factor"] = (float(rp["attention_factor"]), t_.FLOAT32)
        tensors["rope_freqs.weight"] = np.asarray(factors, dtype=np.float32)
        notes.append(f"longrope: the {'long' if long else 'short'} factors for every sequence (served length {length} "
                     f"{'>' if long else '<='} T = {t}); ropescale switches per sequence length")
    else:
        raise ExportRefused(f"llama.cpp: no translation for transformers rope type {kind!r}")
    out = GgufRope(arch, kv, tensors, notes, int(d), float(ctx["rope_theta"]), kind)
    _check_arch_reads_tensors(out)
    return out


def _llama3_divisors(rp: dict[str, Any], d: int) -> np.ndarray:
    """Llama 3.1's per-pair divisors θ_i/θ'_i, float32 ``[d/2]``: 1 for λ < T/high_freq_factor, s for
    λ > T/low_freq_factor, 1/((1 − g)/s + g) in between, g = (T/λ − low)/(high − low)."""
    s, low, high = float(rp["factor"]), float(rp["low_freq_factor"]), float(rp["high_freq_factor"])
    t = float(rp["original_max_position_embeddings"])
    out = []
    for i in range(d // 2):
        wavelen = 2 * math.pi * float(rp["rope_theta"]) ** (2 * i / d)
        if wavelen < t / high:
            out.append(1.0)
        elif wavelen > t / low:
            out.append(s)
        else:
            g = (t / wavelen - low) / (high - low)
            out.append(1 / ((1 - g) / s + g))
    return np.asarray(out, dtype=np.float32)


def rewrite_gguf(src: str | os.PathLike, dst: str | os.PathLike, rope: GgufRope) -> Path:
    """Copy the GGUF ``src`` to ``dst`` with its rope metadata and rope tensors replaced by ``rope``.

    Every key of ``ROPE_KEYS`` (``{arch}.rope.freq_base``, ``rope.scaling.*`` but ``finetuned``) and
    tensor of ``ROPE_TENSORS`` in ``src`` is dropped and ``rope``'s written instead; every other key
    (value type and array item type kept) and tensor (type, shape and bytes) is copied. ``rope``
    is re-keyed to ``src``'s architecture. The copy is written into a staging folder and renamed
    to ``dst`` once complete (``ropescale.serving.output.staged``): a failed write (a full disk)
    leaves no ``dst``, nor the folders made for it.
    Raises ``ExportRefused`` (before writing anything) when
    ``src``'s ``rope.dimension_count`` or ``rope.freq_base`` is not the patched model's rotary dim or
    ``rope_theta`` (relative 1e-6), or its architecture ignores ``rope``'s ``rope_freqs``;
    ``InvalidInput`` when ``src`` is missing, not a GGUF (cut short or corrupted included), or the
    same file as ``dst``; ``OutputError`` when ``dst`` cannot be written (``ropescale.serving.output``);
    ``GgufUnavailable`` without the ``gguf`` package.
    """
    gguf = _gguf()
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise InvalidInput(f"{src}: no such GGUF file")
    if same_path(dst, src):  # any spelling, symlinks, hard links
        raise InvalidInput(f"{dst}: writing over the source GGUF; choose another output path")
    reader, fields = _read_gguf(gguf, src)
    arch = fields.get("general.architecture", (None, None))[1]
    if arch is None:
        raise InvalidInput(f"{src}: GGUF without general.architecture")
    rope = rope.for_arch(arch)
    _check_arch_reads_tensors(rope)
    _check_same_model(fields, arch, rope, src)
    drop = {f"{arch}.{k}" for k in ROPE_KEYS} | set(rope.kv)
    with staged(dst.parent, what=f"output {dst}") as stage:
        _write(gguf, reader, fields, drop, rope, stage / dst.name, arch)
    return dst


# what gguf-py's reader raises for a file that is not a GGUF, cut short or corrupted (measured on
# every truncation of a small GGUF and on random byte flips: ValueError — UnicodeDecodeError and
# unknown enum values included —, IndexError; OSError for an unreadable or empty file)
_READ_ERRORS = (ValueError, IndexError, KeyError, OverflowError, OSError)


def _read_gguf(gguf, path: Path):
    """``(reader, fields)``: gguf-py's reader of ``path`` and every field read (name → ``(field,
    contents)``) and every tensor's data located; ``InvalidInput`` (one line) when ``path`` is not
    a readable GGUF."""
    try:
        reader = gguf.GGUFReader(path)
        fields = {f.name: (f, f.contents()) for f in reader.fields.values()}
        for t in reader.tensors:
            _ = t.data.shape, t.data.dtype
    except _READ_ERRORS as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise InvalidInput(f"{path}: not a readable GGUF (cut short, corrupted or not a GGUF: {type(e).__name__}"
                           + (f": {first[:160]}" if first else "") + ")") from None
    return reader, fields


def _write(gguf, reader, fields: dict, drop: set, rope: GgufRope, path: Path, arch: str) -> None:
    """``path``: the GGUF of ``reader`` (its ``fields``) without the keys ``drop`` and the rope
    tensors, with ``rope``'s keys and tensors."""
    writer = gguf.GGUFWriter(path, arch)
    alignment = int(reader.alignment)
    if alignment != gguf.GGUF_DEFAULT_ALIGNMENT:
        writer.add_custom_alignment(alignment)  # pads the data as the copied general.alignment says
    for name, (f, contents) in fields.items():
        if name in ("general.architecture", "general.alignment") or name.startswith("GGUF.") or name in drop:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, contents, vtype, sub_type=sub)
    for key, (value, vtype) in rope.kv.items():
        writer.add_key_value(key, value, vtype)
    kept = [t for t in reader.tensors if t.name not in ROPE_TENSORS]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    new = {name: np.ascontiguousarray(arr, dtype=np.float32) for name, arr in rope.tensors.items()}
    for name, arr in new.items():
        writer.add_tensor_info(name, arr.shape, arr.dtype, arr.nbytes, gguf.GGMLQuantizationType.F32)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in kept:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        for arr in new.values():
            writer.write_tensor_data(arr)
    finally:
        writer.close()


def _check_arch_reads_tensors(rope: GgufRope) -> None:
    """``ExportRefused`` for ``rope_freqs`` on an architecture whose llama.cpp graph loads
    ``rope_factors_long/short`` instead (Phi-3 types): the runtime would ignore the factors."""
    if rope.arch in _LONGROPE_ARCHS and "rope_freqs.weight" in rope.tensors:
        raise ExportRefused(f"llama.cpp: the {rope.arch} architecture reads rope_factors_long/short, never "
                            f"rope_freqs, so the {rope.rope_type or 'rope'} factors would be ignored; "
                            f"{rope.rope_type or 'this rope'} cannot be exported for {rope.arch}")


def _check_same_model(fields: dict, arch: str, rope: GgufRope, src: Path) -> None:
    """``ExportRefused`` when the GGUF's rotary dim or rope base is not the patched model's (a GGUF of
    another model); keys absent from the GGUF are not checked. ``fields``: ``_read_gguf``'s."""
    dim = fields.get(f"{arch}.rope.dimension_count", (None, None))[1]
    base = fields.get(f"{arch}.rope.freq_base", (None, None))[1]
    try:
        dim, base = (None if dim is None else int(dim)), (None if base is None else float(base))
    except (TypeError, ValueError):
        raise InvalidInput(f"{src}: {arch}.rope.dimension_count / freq_base are not numbers (a corrupted GGUF)") \
            from None
    if rope.dim is not None and dim is not None and dim != rope.dim:
        raise ExportRefused(f"llama.cpp: {src} has {arch}.rope.dimension_count {int(dim)} but the "
                            f"patched model's rotary dim is {rope.dim}; give the GGUF of the same model")
    if rope.base is not None and base is not None:
        theirs = base
        if abs(theirs - rope.base) > 1e-6 * abs(rope.base):
            raise ExportRefused(f"llama.cpp: {src} has {arch}.rope.freq_base {theirs:g} but the patched model's "
                                f"rope_theta is {rope.base:g}; give the GGUF of the same (unpatched) model")


def read_gguf_rope(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(kv, tensors)`` of a GGUF for ``llama_cpp_rope``: every scalar/string key (arrays left out)
    and the rope tensors (``ROPE_TENSORS``) as float32 arrays. Raises ``InvalidInput`` for a file
    that is missing or not a GGUF (cut short or corrupted included); ``GgufUnavailable`` without
    the ``gguf`` package."""
    gguf = _gguf()
    path = Path(path)
    if not path.is_file():
        raise InvalidInput(f"{path}: no such GGUF file")
    reader, fields = _read_gguf(gguf, path)
    kv = {name: contents for name, (f, contents) in fields.items()
          if f.types and f.types[0] != gguf.GGUFValueType.ARRAY and not name.startswith("GGUF.")}
    tensors = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors if t.name in ROPE_TENSORS}
    return kv, tensors


def _value(v: Any) -> Any:
    return v[0] if isinstance(v, tuple) else v


def llama_cpp_rope(kv: dict[str, Any], tensors: dict[str, np.ndarray], n_ctx: int, head_dim: int, *,
                   yarn_beta_fast: float | None = None, yarn_beta_slow: float | None = None,
                   yarn_attn_factor: float | None = None) -> EngineRope:
    """What llama.cpp computes for a GGUF's rope metadata ``kv`` (key → value, or ``GgufRope.kv``'s
    ``(value, type)``) and rope ``tensors`` (name → ``[d/2]``) at context size ``n_ctx`` [tokens].

    ``head_dim``: used as d when the GGUF has no ``{arch}.rope.dimension_count``. The keyword
    arguments are llama.cpp's runtime options (``--yarn-beta-fast`` …; None: unset).
    Per pair i (float32, as ggml computes it): θ_i = (b^(−2/d))^i by repeated products, divided by
    the ``rope_freqs`` divisor — or, for ``rope.scaling.type = longrope`` and Phi-3-type
    architectures, by ``rope_factors_long`` when the context padded to a multiple of 256 exceeds
    ``original_context_length``, else ``rope_factors_short`` (once per context, not per
    sequence; ``rope_freqs`` is then not loaded); times ``freq_scale`` = 1/s
    (1 for type ``none``); for YaRN mixed with the unscaled θ_i by the ramp over
    [⌊corr(β_fast)⌋, ⌈corr(β_slow)⌉], corr(β) = d·ln(T/(2πβ))/(2 ln b) — floor and ceil always, like
    transformers' ``truncate`` (its default). Magnitude: ``yarn_attn_factor`` × (1 + 0.1·ln s) for
    YaRN, where the runtime factor is overwritten by get_mscale(s)/(1 + 0.1·ln s) = 1 (so a runtime
    ``--yarn-attn-factor`` is lost) and multiplied by ``rope.scaling.attn_factor``; without YaRN
    the runtime factor (default 1) times ``rope.scaling.attn_factor``.
    ``failure``: an unknown ``rope.scaling.type`` (llama.cpp aborts loading the model).
    Raises ``InvalidInput`` for a bad ``n_ctx`` or a ``kv`` without ``general.architecture``.
    """
    n_ctx = check_length(n_ctx, "n_ctx")
    kv = {k: _value(v) for k, v in kv.items()}
    arch = kv.get("general.architecture") or next(
        (k.split(".rope.")[0] for k in kv if ".rope." in k), None)
    if arch is None:
        raise InvalidInput("GGUF metadata without general.architecture nor any {arch}.rope.* key")
    r = f"{arch}.rope."
    f32 = np.float32
    n_dims = int(kv.get(r + "dimension_count", head_dim))
    base = f32(kv.get(r + "freq_base", 10000.0))
    kind = str(kv.get(r + "scaling.type", "linear"))  # llama-model.cpp: default "linear"
    factor = kv.get(r + "scaling.factor", kv.get(r + "scale_linear", 0.0)) or 0.0
    freq_scale = f32(1.0) if factor == 0.0 else f32(1.0) / f32(factor)
    n_ctx_train = int(kv.get(f"{arch}.context_length", n_ctx))
    n_orig = int(kv.get(r + "scaling.original_context_length", n_ctx_train))
    rope_attn = f32(kv.get(r + "scaling.attn_factor", 1.0))
    log_mul = float(kv.get(r + "scaling.yarn_log_multiplier", 0.0))
    note = f"llama.cpp rope.scaling.type {kind!r}"
    if kind not in ("none", "linear", "yarn", "longrope"):
        nan = torch.full((n_dims // 2,), math.nan, dtype=torch.float64)
        return EngineRope(nan, math.nan, 1.0, note, f"llama.cpp aborts loading: unknown rope.scaling.type {kind!r}")
    if kind == "none":
        freq_scale = f32(1.0)
    ext = f32(1.0) if kind == "yarn" else f32(0.0)
    attn = f32(1.0 if yarn_attn_factor is None else yarn_attn_factor)
    if ext != 0:
        s = f32(1.0) / freq_scale

        def mscale(scale, m):
            return f32(1.0) if scale <= 1 else f32(0.1) * f32(m) * f32(math.log(scale)) + f32(1.0)

        attn = mscale(s, 1.0) / mscale(s, log_mul) if log_mul != 0 else mscale(s, 1.0)
        attn = f32(attn * (f32(1.0) / (f32(1.0) + f32(0.1) * f32(math.log(s)))))
        if yarn_attn_factor is not None:
            note += f"; runtime yarn_attn_factor {yarn_attn_factor:g} overwritten"
    attn = f32(attn * rope_attn)
    beta_fast = f32(32.0 if yarn_beta_fast is None else yarn_beta_fast)
    beta_slow = f32(1.0 if yarn_beta_slow is None else yarn_beta_slow)
    for key in ("scaling.yarn_beta_fast", "scaling.yarn_beta_slow"):
        if r + key in kv and arch == "llama":
            note += f"; {r + key} not read by the llama architecture"

    def corr_dim(n_rot):
        return f32(n_dims) * f32(math.log(f32(n_orig) / (f32(n_rot) * f32(2) * f32(math.pi)))) / (
            f32(2) * f32(math.log(base)))

    low = max(f32(0), f32(math.floor(corr_dim(beta_fast))))
    high = min(f32(n_dims - 1), f32(math.ceil(corr_dim(beta_slow))))
    if kind == "longrope" or arch in _LONGROPE_ARCHS:  # rope_factors_long/short loaded instead of rope_freqs
        n_ctx_seq = -(-n_ctx // 256) * 256  # llama-context.cpp pads the context to a multiple of 256
        long = n_ctx_seq > n_orig
        ff = tensors.get("rope_factors_long.weight" if long else "rope_factors_short.weight")
        note += f"; {'long' if long else 'short'} factors (context {n_ctx_seq} after padding, T = {n_orig})"
    else:
        ff = tensors.get("rope_freqs.weight", tensors.get("rope_freqs"))
    theta_scale = f32(base ** f32(-2.0 / n_dims))
    theta = f32(1.0)
    out = np.empty(n_dims // 2, dtype=np.float64)
    for i in range(n_dims // 2):
        extrap = f32(theta / f32(ff[i])) if ff is not None else theta
        interp = f32(freq_scale * extrap)
        value = interp
        if ext != 0:
            y = f32((i - low) / max(f32(0.001), f32(high - low)))  # rope_yarn_ramp: i0/2 = i
            mix = f32((f32(1) - min(f32(1), max(f32(0), y))) * ext)
            value = f32(interp * (f32(1) - mix) + extrap * mix)
        out[i] = value
        theta = f32(theta * theta_scale)
    magnitude = attn * (f32(1.0) + f32(0.1) * f32(math.log(f32(1.0) / freq_scale))) if ext != 0 else attn
    return EngineRope(torch.from_numpy(out), float(magnitude), 1.0, note)
