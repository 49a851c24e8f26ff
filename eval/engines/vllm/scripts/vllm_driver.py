"""vLLM driver: runs inside vLLM's own environment (never imports ropescale).

    python vllm_driver.py REQUEST.json RESULT.json

Modes (``request["mode"]``):

``logprobs``: ``{"jobs": [{"model": DIR, "max_model_len": N, "ids": [[int, ...], ...],
"hf_overrides": {...} | null}, ...]}`` → ``{"jobs": [{"logprobs": [[float, ...], ...], "seconds": s}
| {"error": line}, ...], "vllm": version}`` (a job vLLM refuses to load, or whose engine dies
while scoring, is an ``error``; the next still runs). Each job is one ``LLM(model=DIR,
dtype="float32", enforce_eager=True, max_model_len=N)``; each sequence of ids is a ``TokensPrompt`` (the same ids
ropescale scores) with ``prompt_logprobs=0``; ``logprobs[k][j]`` is log p(ids[j+1] | ids[:j+1]) as
vLLM computes it (a NaN stays NaN: vLLM past its cos/sin cache). Sets ``VLLM_CPU_KVCACHE_SPACE=1``,
``VLLM_CPU_OMP_THREADS_BIND=nobind`` and (here only: the prompt is L tokens and one more is
generated) ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` unless given.

``score``: ``{"model": DIR, "max_model_len": N, "dtype": name, "tensor_parallel_size": t,
"data_parallel_size": d, "requests": [{"ids": [int, ...], "max_tokens": n, "prompt_logprobs": bool}, ...]}``
→ ``{"results": [{"logprobs": [float, ...] | null, "tokens": [int, ...]}, ...], "vllm": version,
"start_seconds": s, "score_seconds": s}`` or ``{"error": line, ...}`` when vLLM refuses the model: one
``LLM(...)`` (``enforce_eager``, seed 0; the parallel sizes passed only when above 1) and one
``generate`` over every request, greedy (temperature 0) for ``max_tokens`` tokens; ``logprobs`` as in
``logprobs`` mode (log p(ids[j+1] | ids[:j+1])), when asked.

``rope``: ``{"cases": [{"model": DIR, "max_model_len": N, "hf_overrides": {...} | null, "length": L}
| {"head_size": int, "rotary_dim": int | null, "max_position": int, "rope_parameters": {...},
"length": L}, ...]}`` → per case ``{"class": name, "cache_length": n,
"cos": [[...]], "sin": [[...]]}``: vLLM's own rotary module from ``get_rope(...)``
(``model_executor/layers/rotary_embedding/__init__.py``) applied by its ``forward_native`` to unit
vectors at positions 0 … L−1 (neox style, as Llama), over the module's own ``rotary_dim`` (a partial
rotary factor in the config's ``rope_parameters`` included). With ``model``, the config goes through
vLLM's own ``ModelConfig(model=DIR, max_model_len=N, hf_overrides=...)`` first (its rope
standardisation and its ``max_model_len`` check; a refusal is reported as ``error``) and
``get_rope`` gets what vLLM's Llama passes it: ``head_dim``, ``max_position_embeddings``,
``rope_parameters`` (and Qwen3.5's and Qwen3-VL's ``mrope_positions_factor``) — with ``"layer_type": T``
in the case, ``rope_parameters[T]``, as vLLM's Gemma 3 attention passes each layer's.
``cos[m][i]`` = magnitude·cos(angle of pair i at position m); positions past what the module can rotate
are reported as ``cache_length`` (and left out) instead of an error; ``inv_freq`` [rad/token] is the angle
at position 1, ``magnitude`` the mean cos/sin norm at position 0.
``"positions": [0, 1, …]`` in a case measures only those (a long L; ``positions`` in the
answer: those evaluated, the rows of ``cos``/``sin``). A DeepSeek model (``DEEPSEEK_ARCHS``) gets what its
attention does first: the rope type rewritten (``deepseek_yarn``, or ``deepseek_llama_scaling`` when
``attention_factor`` is 1.0) and ``softmax_scale`` mscale(s, ``mscale_all_dim``)² for ``deepseek_yarn`` (else
1). ``architectures`` and ``llama_4_scaling`` (Mistral's query temperature, as mistral.py reads it) come back
as the config gave them. ``{"error": line}`` for a case vLLM refuses.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

# architectures whose vLLM model is deepseek_v2.py's MLA attention (ropescale.serving.engines.vllm.DEEPSEEK_ARCHS)
DEEPSEEK_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def _env() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def logprobs(request: dict) -> dict:
    """Per job (an exported folder and token windows): vLLM's prompt log-probability of each next token [nats]."""
    # the prompt is L tokens and one is generated: max_model_len L + 1 may exceed the config's length
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    out = []
    for job in request["jobs"]:
        start = time.perf_counter()
        kwargs = {"hf_overrides": job["hf_overrides"]} if job.get("hf_overrides") else {}
        try:
            llm = LLM(model=job["model"], dtype="float32", max_model_len=int(job["max_model_len"]),
                      enforce_eager=True, seed=0, **kwargs)
        except Exception as e:  # noqa: BLE001 — vLLM refusing a config is a result, the next job still runs
            out.append({"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}",
                        "seconds": time.perf_counter() - start})
            continue
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in job["ids"]]
        try:
            results = llm.generate(prompts, params, use_tqdm=False)
        except Exception as e:  # noqa: BLE001 — e.g. past LongRoPE's cache: its engine dies, the next job starts a new one
            out.append({"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}",
                        "seconds": time.perf_counter() - start})
            del llm
            continue
        seqs = []
        for ids, r in zip(job["ids"], results):
            row = []
            for j, entry in enumerate(r.prompt_logprobs[1:], start=1):
                lp = entry[int(ids[j])].logprob if entry is not None and int(ids[j]) in entry else float("nan")
                row.append(float(lp))
            seqs.append(row)
        out.append({"logprobs": seqs, "seconds": time.perf_counter() - start})
        del llm
        import gc

        gc.collect()
    return {"jobs": out, "vllm": vllm.__version__}


def score(request: dict) -> dict:
    """One scoring request of the harness's vLLM engine: log-probabilities or generations per prompt."""
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # the token generated after a full window
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    kwargs = {k: int(request[k]) for k in ("tensor_parallel_size", "data_parallel_size") if int(request.get(k, 1)) > 1}
    try:
        llm = LLM(model=request["model"], dtype=request.get("dtype", "float32"),
                  max_model_len=int(request["max_model_len"]), enforce_eager=True, seed=0, **kwargs)
    except Exception as e:  # noqa: BLE001 — vLLM refusing the model is the answer
        return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}", "vllm": vllm.__version__}
    started = time.perf_counter()
    reqs = request["requests"]
    params = [SamplingParams(max_tokens=int(r["max_tokens"]), temperature=0.0,
                             prompt_logprobs=0 if r.get("prompt_logprobs") else None) for r in reqs]
    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in r["ids"]]) for r in reqs]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    results = []
    for r, o in zip(reqs, outputs):
        lp = None
        if r.get("prompt_logprobs"):
            ids = r["ids"]
            lp = [float(e[int(ids[j])].logprob) if e is not None and int(ids[j]) in e else float("nan")
                  for j, e in enumerate(o.prompt_logprobs[1:], start=1)]
        results.append({"logprobs": lp, "tokens": [int(t) for t in o.outputs[0].token_ids]})
    return {"results": results, "vllm": vllm.__version__, "start_seconds": started - start,
            "score_seconds": time.perf_counter() - started}


def rope(request: dict) -> dict:
    """Per case: vLLM's own rotary module from ``get_rope(...)``, built as its Llama builds it from the exported
    config, and its cos/sin tables up to L (see the module docstring)."""
    import torch
    import vllm
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding

    out = []
    for case in request["cases"]:
        try:
            model_config = None
            if case.get("model"):
                model_config, read = _from_model(case)
                case = {**case, **read}
            head = int(case["head_size"])
            rot = int(case.get("rotary_dim") or head)
            # LongRoPE reads max_model_len from the current config; get_rope's cache key lacks it
            rotary_embedding._ROPE_DICT.clear()
            with set_current_vllm_config(VllmConfig(model_config=model_config,
                                                    device_config=DeviceConfig(device="cpu"))):
                module = _get_rope(rotary_embedding.get_rope, head, rot, int(case["max_position"]),
                                   case["rope_parameters"], case.get("mrope_positions_factor"))
            # the rotary dim the module was built with: a config's partial_rotary_factor (Qwen3.5's 0.25), read
            # by get_rope from rope_parameters, rotates the first rotary_dim channels (pairs i, i + rotary_dim/2)
            rot = int(getattr(module, "rotary_dim", None) or rot)
        except Exception as e:  # noqa: BLE001 — vLLM's refusal, reported as data
            out.append({"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"})
            continue
        cache = getattr(module, "long_short_cos_sin_cache", getattr(module, "cos_sin_cache", None))
        cache_len = int(cache.shape[0]) if cache is not None else None
        if hasattr(module, "long_short_cos_sin_cache"):  # short cache of T positions, then the long one
            t = int(module.original_max_position_embeddings)
            cache_len = cache_len - t if module.use_long_rope else t
        length = int(case["length"])
        limit = length if cache_len is None else min(length, cache_len)
        positions = [p for p in (case.get("positions") or range(limit)) if p < limit]
        cos, sin, n = _rotate(module, head, rot, positions)
        inv_freq = [math.atan2(s_, c_) for s_, c_ in zip(sin[1], cos[1])] if n > 1 else []
        magnitude = float(sum(math.hypot(c_, s_) for c_, s_ in zip(cos[0], sin[0])) / len(cos[0])) if n else None
        out.append({"class": type(module).__name__, "cache_length": cache_len,
                    "softmax_scale": float(case.get("softmax_scale", 1.0)),
                    "architectures": case.get("architectures"), "llama_4_scaling": case.get("llama_4_scaling"),
                    "evaluated": positions[-1] + 1 if n else 0, "positions": positions[:n],
                    "inv_freq": inv_freq, "magnitude": magnitude,
                    "max_position": int(case["max_position"]), "rope_parameters": case["rope_parameters"],
                    "use_long_rope": getattr(module, "use_long_rope", None), "cos": cos, "sin": sin})
    return {"cases": out, "vllm": vllm.__version__, "torch": torch.__version__}


def _from_model(case: dict):
    """``(ModelConfig, {head_size, max_position, rope_parameters})`` as vLLM's Llama reads them from
    a model folder."""
    from vllm.config import ModelConfig

    kwargs = {"hf_overrides": case["hf_overrides"]} if case.get("hf_overrides") else {}
    mc = ModelConfig(model=case["model"], dtype="float32", max_model_len=int(case["max_model_len"]), **kwargs)
    text = mc.hf_text_config
    try:
        head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    except Exception:  # noqa: BLE001 — Gemma 4's config: head_dim is per layer (per_layer_config), as its model reads it
        head = text.per_layer_config[case["layer_type"]].head_dim
    rope_parameters = dict(text.rope_parameters)
    if case.get("layer_type"):  # Gemma 3's attention: get_rope(..., rope_parameters=config.rope_parameters[layer_type])
        rope_parameters = dict(rope_parameters[case["layer_type"]])
    softmax = 1.0
    archs = set(getattr(mc.hf_config, "architectures", None) or [])
    if archs & set(DEEPSEEK_ARCHS) and rope_parameters.get("rope_type", "default") != "default":
        # what deepseek_v2.py's attention does before get_rope (DeepseekV2MLAAttention.__init__, vLLM 0.32.0):
        # the rope type rewritten, and for deepseek_yarn the softmax scale times mscale(s, mscale_all_dim)²
        kind = "deepseek_llama_scaling" if rope_parameters.get("attention_factor") == 1.0 else "deepseek_yarn"
        rope_parameters["rope_type"] = kind
        if kind == "deepseek_yarn":
            from vllm.model_executor.models.deepseek_v2 import yarn_get_mscale

            mscale = yarn_get_mscale(rope_parameters["factor"], float(rope_parameters.get("mscale_all_dim", False)))
            softmax = mscale * mscale
    return mc, {"head_size": int(head), "max_position": int(getattr(text, "max_position_embeddings", 8192)),
                "rope_parameters": rope_parameters, "max_model_len_used": int(mc.max_model_len),
                "softmax_scale": softmax, "architectures": sorted(archs),
                "llama_4_scaling": getattr(text, "llama_4_scaling", None),  # what mistral.py's attention reads
                "mrope_positions_factor": _mrope_positions_factor(mc, archs)}


def _mrope_positions_factor(mc, archs: set) -> int | None:
    """What Qwen3-VL's and Qwen3.5's decoder layers pass ``get_rope`` as ``mrope_positions_factor``
    (``qwen3_vl.mrope_positions_factor``, vLLM 0.32.0 and 0.34.0): 4 with multimodal pruning, else 1 — the
    M-RoPE class takes its cos/sin cache, and its YaRN its original window, as that many times the config's;
    None (``get_rope``'s default, 4) for every other model."""
    if not any(a.startswith(("Qwen3_5", "Qwen3VL")) for a in archs):
        return None
    mm = getattr(mc, "multimodal_config", None)
    return 4 if mm is not None and mm.is_multimodal_pruning_enabled() else 1


def _get_rope(get_rope, head: int, rot: int, max_position: int, rope_parameters: dict,
              mrope_positions_factor: int | None = None):
    """``get_rope`` across its keyword spellings (0.32: ``head_size, max_position, is_neox_style,
    rope_parameters, dtype``; ``rotary_dim`` only through ``partial_rotary_factor``), with the model's
    ``mrope_positions_factor`` where it passes one."""
    import inspect

    import torch

    names = inspect.signature(get_rope).parameters
    kwargs = {"head_size": head, "max_position": max_position, "is_neox_style": True, "dtype": torch.float32}
    rp = dict(rope_parameters)
    if rot != head:
        if "rotary_dim" in names:
            kwargs["rotary_dim"] = rot
        else:
            rp["partial_rotary_factor"] = rot / head
    elif "rotary_dim" in names:
        kwargs["rotary_dim"] = rot
    kwargs["rope_parameters" if "rope_parameters" in names else "rope_scaling"] = rp
    if "base" in names:
        kwargs["base"] = rp.get("rope_theta", 10000.0)
    if mrope_positions_factor is not None and "mrope_positions_factor" in names:
        kwargs["mrope_positions_factor"] = int(mrope_positions_factor)
    return get_rope(**kwargs)


def _rotate(module, head: int, rot: int, at: list[int]):
    """``(cos, sin, n)``: cos/sin·magnitude per pair at positions ``at`` (n of them) from the module's own
    forward_native: the query is the unit vector of each pair's first channel in turn (neox: pair
    i = channels i, i + rot/2)."""
    import torch

    half, n = rot // 2, len(at)
    positions = torch.tensor(at, dtype=torch.long)
    q = torch.zeros(n, half, head, dtype=torch.float32)  # [positions, probe, head]: probe i → channel i
    q[:, torch.arange(half), torch.arange(half)] = 1.0
    fwd = getattr(module, "forward_native", None) or module.forward
    qo = None
    # [n, heads·head_size] as the generic classes take it, else [n, heads, head_size] (DeepSeek's slices the last dim)
    for shape in ((n, half * head), (n, half, head)):
        try:
            out, _ = fwd(positions, q.reshape(shape), q.reshape(shape).clone())
        except (IndexError, RuntimeError):
            continue
        if out.numel() == q.numel():  # DeepSeek's broadcasts a 2-D query into another shape
            qo = out
            break
    if qo is None:
        return [], [], 0
    qo = qo.reshape(n, half, head)
    idx = torch.arange(half)
    cos = qo[:, idx, idx].double()
    sin = qo[:, idx, idx + half].double()
    return cos.tolist(), sin.tolist(), n


def main() -> int:
    """Read one JSON request on stdin (``mode``: rope, logprobs or score), write the JSON answer on stdout."""
    _env()
    request = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    result = {"logprobs": logprobs, "rope": rope, "score": score}[request["mode"]](request)
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    code = main()
    # the result is written: leave without vLLM's teardown, whose worker threads can abort the
    # interpreter at exit ("terminate called without an active exception", exit -6; seen once in
    # test_engine_vllm under load), which would discard a finished cell
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
