"""Record the goldens of ``tests/data/authors/``: the authors' own code, unmodified, run on the tiny
Llama of ``tiny.py`` in float64, under the transformers release the authors pin, with a CPU stand-in for
flash-attn (``flash_stub.py``); what it computed is saved as ``<rule>.pt`` and its provenance in
``<rule>.json``. The tests (``tests/strategies/test_dpe.py``, ``test_lampe.py``) run
ropescale on the same model and inputs and compare.

Run from the repository root, one rule at a time, with the authors' repository checked out or mirrored
(a bare git directory is read with ``git show``, nothing is copied into this repository) and their
transformers on ``PYTHONPATH`` (torch from the project's environment)::

    pip install --no-deps --target /tmp/tf4.47.0 transformers==4.47.0 tokenizers==0.21.0 huggingface_hub==0.26.5
    PYTHONPATH=/tmp/tf4.47.0 python tests/data/authors/record.py dpe --repo PATH/TO/LuLuLuyi/DPE

(LaMPE: transformers 4.43.3 with tokenizers 0.19.1; GALI: transformers 4.46.2 with tokenizers 0.20.3.)
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import flash_stub  # noqa: E402
import tiny  # noqa: E402

# the goldens' settings (the tests read them from the .pt files)
DPE = {"window": 16, "scales": [2, 16, 8, 4, 1, 2, 16, 4], "prompt": 100, "decode": 6}
LAMPE = {"prompts": [{"n": 100, "head": 8, "tail": 5, "use_length": 40},  # middle compressed
                     {"n": 90, "head": 12, "tail": 20, "use_length": None},  # U = remap_uselen(90, llama3) = 1536
                     {"n": 20, "head": 12, "tail": 5, "use_length": 40}],  # N < 2·head: plain RoPE × factor
         "remap": [100, 8191, 8192, 16384, 32768, 65536, 131072, 262144]}
GALI = {"prompts": [{"n": 100, "local_window": 16},  # g = 2
                    {"n": 200, "local_window": 16},  # g = 4
                    {"n": 150, "local_window": 0}],  # g = 3, no local window
        "positions": [[100, 64, 16], [200, 64, 16], [150, 64, 0], [8192 * 4, 8192, 128],
                      [10000, 4096, 128]]}


def authors_module(repo: str, commit: str, path: str, name: str):
    """The authors' file ``path`` at ``commit`` of ``repo`` (a work tree or a bare git directory), imported as
    module ``name`` from a temporary copy outside this repository, with the flash-attn stand-in installed
    (after transformers' Llama and Mistral are imported, so transformers itself sees no flash-attn)."""
    import transformers.models.llama.modeling_llama
    import transformers.models.mistral.modeling_mistral  # noqa: F401  (LaMPE patches it too)

    flash_stub.install()
    source = subprocess.run(["git", "-C", repo, "show", f"{commit}:{path}"], check=True, capture_output=True,
                            text=True).stdout
    folder = Path(tempfile.mkdtemp(prefix="authors-"))
    (folder / f"{name}.py").write_text(source)
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module, hashlib.sha256(source.encode()).hexdigest()


def tiny_llama():
    """``tiny.CONFIG``'s Llama under the installed (the authors') transformers, eager attention, float64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**tiny.CONFIG)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tiny.load(LlamaForCausalLM(config))


def decode(model, prompt: torch.Tensor, steps: int, next_ids: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The prompt's logits from one forward with a fresh cache, then ``steps`` one-token forwards of
    ``next_ids`` from that cache: (prompt logits ``[1, n, V]``, the step logits ``[1, V]`` each)."""
    with torch.no_grad():
        out = model(prompt, position_ids=torch.arange(prompt.shape[1])[None], use_cache=True)
        cache, steps_out = out.past_key_values, []
        for t in range(steps):
            pos = torch.tensor([[prompt.shape[1] + t]])
            step = model(next_ids[:, t : t + 1], position_ids=pos, past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            steps_out.append(step.logits[:, -1])
    return out.logits, steps_out


def record_dpe(repo: str, commit: str) -> dict:
    """``replace_with_dpe`` (no top-k selection), then a prompt through ``dpe_flash_forward``'s prefill and
    decoding steps through its q_len = 1 branch."""
    mod, digest = authors_module(repo, commit, "dpe_for_llama.py", "dpe_for_llama")
    groups = list(range(9))  # dimension_groups_range: 8 groups of 1 pair (head_dim 16)
    mod.replace_with_dpe(DPE["scales"], DPE["window"], groups, False)
    model = tiny_llama()
    ids = tiny.ids(DPE["prompt"] + DPE["decode"])
    prompt_logits, steps = decode(model, ids[:, : DPE["prompt"]], DPE["decode"], ids[:, DPE["prompt"]:])
    golden = {"ids": ids, "prompt_logits": prompt_logits, "step_logits": torch.cat(steps), **DPE}
    how = (f"replace_with_dpe({DPE['scales']}, {DPE['window']}, {groups}, select_topk_dim_arg=False); the "
           f"{DPE['prompt']}-token prompt in one forward (dpe_flash_forward's q_len == kv_seq_len branch), then "
           f"{DPE['decode']} one-token steps from its cache (the q_len == 1 branch)")
    return golden, {"repository": "github.com/LuLuLuyi/DPE", "file": "dpe_for_llama.py", "sha256": digest,
                    "functions": ["replace_with_dpe", "dpe_flash_forward", "atten_merge_forward"], "how": how}


def record_lampe(repo: str, commit: str) -> dict:
    """``replace_with_hmt`` and ``forward`` bound with ``head``, ``tail``, ``use_length`` per layer (their
    ``modify_method_of_instance(model, ..., partial(forward, ...))``), each prompt's prefill through their
    ``flashdecoding_forward`` and cache; and ``remap_uselen`` on a table of lengths for every fit."""
    import functools
    import math
    import types

    mod, digest = authors_module(repo, commit, "llama_cache1.py", "llama_cache1")
    ids = tiny.ids(max(p["n"] for p in LAMPE["prompts"]), seed=11)
    prompts = []
    for p in LAMPE["prompts"]:
        mod.replace_with_hmt(max_test_length=p["n"], scale_factor=0.1 * math.log(2) + 1)
        model = tiny_llama().float()  # their allocate_inference_cache asserts float16, bfloat16 or float32
        use = mod.remap_uselen(p["n"], "llama3") if p["use_length"] is None else p["use_length"]
        for layer in model.model.layers:
            layer.self_attn.forward = types.MethodType(
                functools.partial(mod.forward, head=p["head"], tail=p["tail"], use_length=use), layer.self_attn)
        with torch.no_grad():
            logits = model(ids[:, : p["n"]], position_ids=torch.arange(p["n"])[None], use_cache=True).logits
        prompts.append({**p, "use_length": use, "logits": logits})
    remap = {fit: {n: mod.remap_uselen(n, fit) for n in LAMPE["remap"]} for fit in ("llama2", "llama3", "mistral",
                                                                                     "llama3.1")}
    golden = {"ids": ids, "prompts": prompts, "remap": remap}
    how = ("for each prompt: replace_with_hmt(max_test_length=n, scale_factor=0.1·ln 2 + 1), every layer's "
           "forward = partial(forward, head, tail, use_length) (use_length None: remap_uselen(n, 'llama3')), the "
           "prompt in one forward with use_cache=True (their prefill branch); remap_uselen(n, fit) for every fit")
    return golden, {"repository": "github.com/scar-on/LaMPE", "file": "llama_cache1.py", "sha256": digest,
                    "licence": "MIT", "dtype": "float32",
                    "functions": ["replace_with_hmt", "forward", "map_ids", "find_chunk_last_index",
                                  "flash_prefill_merge", "flashdecoding_forward", "remap_uselen"],
                    "how": how}


def authors_package(repo: str, commit: str, paths: list[str]) -> tuple[dict, dict]:
    """The authors' files ``paths`` at ``commit`` of ``repo`` written under a temporary folder with their
    package layout (``models/DPI/...``, each folder given an empty ``__init__.py``) put first on ``sys.path``,
    so their own imports (``from models.DPI.help_funcs import *``) resolve: ({path: module}, {path: sha256})."""
    folder = Path(tempfile.mkdtemp(prefix="authors-"))
    modules, digests = {}, {}
    for path in paths:
        source = subprocess.run(["git", "-C", repo, "show", f"{commit}:{path}"], check=True, capture_output=True,
                                text=True).stdout
        target = folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        for parent in target.relative_to(folder).parents:
            (folder / parent / "__init__.py").touch()
        target.write_text(source)
        digests[path] = hashlib.sha256(source.encode()).hexdigest()
    sys.path.insert(0, str(folder))
    for path in paths:
        modules[path] = importlib.import_module(path[:-3].replace("/", "."))
    return modules, digests


def record_gali(repo: str, commit: str) -> dict:
    """Their ``dpi_llamamodel_forward`` and ``dpi_llamaattn_forward`` bound on the tiny Llama's model and
    attention instances (as their ``get_model_and_tokenizer`` does, through ``modify_method_of_instance``),
    ``config.dpi_config`` = their README's with the noise off (``noise_type`` "no"), each prompt in one
    forward with an all-ones attention mask (as their ``dpi_sample`` passes it) and ``position_ids`` =
    ``construct_new_pi(n − 1, T, add_token=1, local_window=w)`` (their ``prefill_interpolation``'s call): the
    ``appro_attn`` branch, ``attention_score_approximate``. And ``construct_new_pi`` itself on a table of (N, T, w)."""
    import contextlib
    import io
    import types

    mods, digests = authors_package(repo, commit, ["models/DPI/help_funcs.py", "models/DPI/patches/Llama.py"])
    helpers, patches = mods["models/DPI/help_funcs.py"], mods["models/DPI/patches/Llama.py"]
    t = tiny.T

    def new_pi(n, t, w):
        with contextlib.redirect_stdout(io.StringIO()):  # construct_new_pi prints every step
            return helpers.construct_new_pi(n - 1, t, "cpu", [], 1, w)

    ids = tiny.ids(max(p["n"] for p in GALI["prompts"]), seed=13)
    prompts = []
    for p in GALI["prompts"]:
        model = tiny_llama()
        model.config.dpi_config = {"use_chunk_softmax": False, "chunk_coe": 3000, "appro_attn": True,
                                   "local_window": p["local_window"], "noise_type": "no"}
        model.model.forward = types.MethodType(patches.dpi_llamamodel_forward, model.model)
        for layer in model.model.layers:
            layer.self_attn.forward = types.MethodType(patches.dpi_llamaattn_forward, layer.self_attn)
        model.model.rotary_emb.forward = types.MethodType(patches.rope_forward_dpi_with_pi, model.model.rotary_emb)
        pos = new_pi(p["n"], t, p["local_window"])
        with torch.no_grad():
            prompt = ids[:, : p["n"]]  # with its attention mask, as their generate passes it: without one their
            # forward rebuilds the causal mask one row late (DynamicCache's mask is s × (s + 1) in 4.46)
            logits = model(prompt, attention_mask=torch.ones_like(prompt), position_ids=pos[None],
                           use_cache=True).logits
        prompts.append({**p, "position_ids": pos, "logits": logits})
    positions = [{"n": n, "t": tt, "local_window": w, "pi": new_pi(n, tt, w)} for n, tt, w in GALI["positions"]]
    golden = {"ids": ids, "prompts": prompts, "positions": positions}
    how = ("for each prompt: model.forward = dpi_llamamodel_forward, every attention's forward = "
           "dpi_llamaattn_forward, rotary forward = rope_forward_dpi_with_pi (bound per instance), config.dpi_config "
           "= {appro_attn: true, local_window: w, noise_type: 'no', chunk_coe: 3000}; the prompt of n tokens in one "
           "forward with attention_mask = ones (as their generate) and position_ids = "
           "construct_new_pi(n - 1, T, 'cpu', [], 1, w) (float32, as theirs); "
           "construct_new_pi on a table of (n, T, w)")
    return golden, {"repository": "github.com/AcademyCityL/GALI", "file": "models/DPI/patches/Llama.py",
                    "sha256": digests["models/DPI/patches/Llama.py"],
                    "files_sha256": digests, "licence": "MIT",
                    "functions": ["construct_new_pi", "dpi_llamamodel_forward", "dpi_llamaattn_forward",
                                  "attention_score_approximate", "rope_forward_dpi_with_pi"],
                    "how": how}


RECORDERS = {"dpe": record_dpe, "gali": record_gali, "lampe": record_lampe}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rule", choices=sorted(RECORDERS))
    parser.add_argument("--repo", required=True, help="the authors' repository (work tree or bare git directory)")
    parser.add_argument("--commit", default="HEAD")
    args = parser.parse_args()
    import transformers

    commit = subprocess.run(["git", "-C", args.repo, "rev-parse", args.commit], check=True, capture_output=True,
                            text=True).stdout.strip()
    golden, provenance = RECORDERS[args.rule](args.repo, commit)
    torch.save(golden, HERE / f"{args.rule}.pt")
    provenance = {"dtype": "float64"} | provenance  # a recorder may name another
    provenance |= {"commit": commit, "transformers": transformers.__version__, "torch": torch.__version__,
                   "flash_attn": ("not called" if args.rule == "gali"
                                  else "tests/data/authors/flash_stub.py (CPU stand-in)"),
                   "model": "tests/data/authors/tiny.py", "recorded": datetime.date.today().isoformat(),
                   "command": f"PYTHONPATH=<transformers {transformers.__version__}> python "
                              f"tests/data/authors/record.py {args.rule} --repo <{provenance['repository']}> "
                              f"--commit {commit[:7]}",
                   "golden_sha256": hashlib.sha256((HERE / f"{args.rule}.pt").read_bytes()).hexdigest()}
    (HERE / f"{args.rule}.json").write_text(json.dumps(provenance, indent=1) + "\n")
    print(json.dumps(provenance, indent=1))


if __name__ == "__main__":
    main()
