"""What a search minimises, measured on a loaded model: one candidate = patch, score, unpatch.

For a candidate's parameters θ (the strategy's, fixed and auto ones filled at the longest target
length, so one spec serves every length) the objective [nats per token] is

    J(θ) = Σ_L w_L · NLL_L(θ)  +  r · NLL_answer(θ)  +  n · NLL_needle(θ)  +  Σ_k u_k · NLL_k(θ)

- NLL_L: token-weighted mean next-token NLL of ``max_windows`` chunk windows of L tokens of the
  **search split**, evenly spaced over all its windows (``ropescale.runs.windows.cap_windows``: the
  same rule as ``eval``'s; the first ``max_windows`` would all come from the split's first
  document) (``ropescale.runs.scoring.score_windows``); exp(NLL_L) is the PPL at L.
  w_L: ``length_weights`` normalised to sum 1 (equal by default).
- NLL_answer (only when r = ``retrieval_weight`` > 0): the passkey answer's mean NLL per answer
  token after ``retrieval_trials`` passkey prompts of the longest length (the passkey task's
  candidate scoring, ``eval.tasks.retrieval``; depths spread over [0, 1]; seed 7919, not the
  eval's default 0, so the reported passkey prompts are not the searched ones).
- NLL_needle (only when n = ``needle_weight`` > 0): LongRoPE2's needle-driven term, the mean NLL
  per answer token of ``needle_trials`` needles planted in the search split's own text at the
  longest length (``eval.search.needle_objective``).
- NLL_k (``tasks:``, weight u_k each): a task declaring ``objective_term`` — passkey, needle, graphwalks,
  json_kv, a plugin's — as the mean NLL per answer token of the gold answers (``Task.gold_answers``) of
  its first ``trials`` examples at the longest length (``TaskTerm``: seed 7919 unless given).
- Constraint (LongRoPE's short-context concern): c(θ) = PPL_T(θ) / ((1 + ε) · PPL_T(vanilla)) − 1,
  PPL at the training window T on ``max_windows`` windows of the search split; feasible when
  c ≤ 0. It is reported with every trial; the tuner uses it as an Optuna constraint (TPE) or a
  penalty (CMA-ES) — see ``eval.search.tuner``. With ``max_kl`` = κ, the short-context cost joins
  it: c(θ) = max(c_PPL, KL_T(θ) / κ − 1), KL_T the mean KL(P_unpatched ‖ P_θ) per token over the
  same windows at T (``ropescale.runs.scoring.window_nll(kl=True)``), reported as ``kl_train``.

The model is loaded once, and checked with the data before any trial: a model without a rotary
embedding, data too short for a length (or for T), a search split holding a held-out document are
one-line errors (``ConfigError``), refusing the whole search. Then every candidate is patched in
and removed in place (``ropescale.patch``), as a sweep's cell is; a candidate whose parameters the
strategy refuses raises ``eval.search.tuner.Refused`` (that trial is pruned, the search goes on).

Scored by a registered engine outside this process (``engine: NAME``, ``eval.engines.scoring``), a candidate
is the requests a task makes (``Task.engine_requests``' format): each search window of each target length
and of T (its log-probabilities: the same scored targets as ``score_windows``) and, with the retrieval or
needle terms, each prompt + answer (the answer's log-probabilities), handed to the engine in one call
(``ScoringEngine.score_requests``: its export of the live patch, served from
``<search>/<engine>/candidate-<pid>/``, rewritten per candidate). The first window of the longest length is
the parity check's (the engine's tolerance; past it the search stops, ``EngineDisagrees``); the constraint's
vanilla PPL at T is the engine's too. A candidate the engine cannot serve is refused (``Refused``, pruned).
Before anything loads (``check_engine``): an engine answering no log-probabilities, or refusing what the
search serves (``ScoringEngine.check_demand``: one export serves T and every length, nothing frozen at a
length), is one ``ConfigError`` line.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from ropescale.errors import InvalidInput
from ropescale.models import resolve_device
from ropescale.patching import patch
from ropescale.runs.config import ConfigError
from ropescale.runs.data import BOOKS, KJV_SPLITS, load_documents
from ropescale.runs.lifecycle import RunInputs, check_strategy, configured_context, load_run_model, loaded_window
from ropescale.runs.protocol import RunFolder, RunKind
from ropescale.runs.scoring import score_windows
from ropescale.runs.windows import WindowError, make_windows
from ropescale.strategies import BASELINE, get_strategy

from ..engines.answering import Serving
from ..engines.scoring import DEFAULT, Demand, scoring_engine
from ..tasks.prompts import PromptError
from .config import SearchConfig, same_data
from .needle_objective import answer_nll, needle_examples
from .tuner import Refused

__all__ = ["RETRIEVAL_SEED", "Measurement", "SearchObjective", "SearchRun", "check_disjoint", "check_engine",
           "spec_params"]

RETRIEVAL_SEED = 7919  # passkey keys of the search; the eval's default seed is 0


@dataclass(frozen=True)
class Measurement:
    """One candidate's scores. ``nll``/``ppl``: per target length [nats per token / perplexity];
    ``ppl_train``: PPL at T; ``constraint`` ≤ 0 when feasible; ``retrieval_nll``: the passkey
    answer's mean NLL per token and ``needle_nll`` the needles' (None when not measured);
    ``seconds``: wall time."""

    objective: float
    nll: dict[int, float]
    ppl: dict[int, float]
    ppl_train: float
    constraint: float
    retrieval_nll: float | None
    seconds: float
    needle_nll: float | None = None  # LongRoPE2's needle-driven term (eval.search.needle_objective)
    parity: float | None = None  # an engine outside this process: |Δ mean NLL| of the first window [nats]
    kl_train: float | None = None  # with max_kl: mean KL(P_unpatched ‖ P_candidate) per token at T [nats]
    task_nll: dict[str, float] | None = None  # the tasks: terms, by task: mean NLL per gold answer token [nats]

    def row(self) -> dict:
        """Flat columns for ``trials.csv`` (``parity`` only where an engine outside this process scored; a task
        term as ``nll@<task>``)."""
        out = {k: v for k, v in asdict(self).items()
               if k not in ("nll", "ppl", "task_nll") and (k not in ("parity", "kl_train") or v is not None)}
        out.update({f"ppl@{length}": v for length, v in self.ppl.items()})
        out.update({f"nll@{task}": v for task, v in (self.task_nll or {}).items()})
        return out


def check_disjoint(cfg: SearchConfig, texts: list[str]) -> None:
    """``ConfigError`` when a document of the held-out data is also a search document (a copy of
    the held-out file under another name). Checked for held-out data on this machine (the bundled
    splits, local paths); a hub dataset is compared by id only (``same_data``)."""
    held = cfg.heldout.spec() if cfg.heldout is not None else None
    if held is None or same_data(cfg.data.spec(), held):  # the latter refused by the config already
        return
    if held.source not in KJV_SPLITS and held.source not in BOOKS and not Path(held.source).exists():
        return
    shared = set(texts) & set(load_documents(held))
    if shared:
        raise ConfigError(f"data: {cfg.data.spec().describe()} holds {len(shared)} document(s) of the held-out data "
                          f"{held.describe()} results are reported on; search on other documents")


def check_engine(cfg: SearchConfig, source: str = "config", processes: int = 1) -> None:
    """What the search's engine refuses before anything loads (``ConfigError``, one line): an engine outside
    this process that answers no log-probabilities, or refuses to serve the strategy for T and every target
    length in one export (``ScoringEngine.check_demand``)."""
    scorer = scoring_engine(cfg.engine)
    if scorer.in_process:
        return
    if "logprobs" not in scorer.answers:
        raise ConfigError(f"{source}: engine: {cfg.engine} does not answer logprobs, which a search asks for — use "
                          f"engine: {DEFAULT}")
    need = max(*cfg.lengths, cfg.original_max_position_embeddings or 0) + 1
    spec = SimpleNamespace(name=cfg.strategy, display=cfg.strategy, logn=False, temperature=None)
    demand = Demand(strategies=[spec], tokens=need, holds=f"a window of {need - 1} holds", key="strategy",
                    static="a search scores T and every length in one engine")
    scorer.check_demand(demand, scorer.section(cfg), source, processes)


def spec_params(strategy: str, fixed: dict, sampled: dict, *, length: int, train_length: int,
                context: dict | None = None) -> dict:
    """The parameters a candidate is applied with and written as (``best.json``): the fixed ones,
    ``auto`` ones the user left out filled for target ``length`` (``factor`` = max(1, L / T)), and
    the sampled ones. Raises ``ValueError`` (one line) when the strategy refuses the combination
    (yarn's beta_fast ≤ beta_slow). ``context``: the model's (``Strategy.resolve``: DCA's defaults)."""
    strat = get_strategy(strategy)
    given = {**fixed, **sampled}
    full = strat.resolve(given, length=length, train_length=train_length, context=context)
    auto = {p.name: full[p.name] for p in strat.params if p.auto and p.name not in given}
    return {**fixed, **auto, **sampled}


class SearchObjective:
    """The objective of ``cfg`` on its model, loaded once from the run's ``inputs`` (tokenizer
    and search split, read once by ``ropescale.runs.protocol``). ``objective(sampled)`` →
    ``(params, Measurement)``.

    Raises (one line, before any trial): ``ConfigError`` for a model without a rotary embedding or
    a training window, data too short for a length or for T, a search split that holds a held-out
    document; the loaders' own errors (``DataError``, a model that cannot be loaded)."""

    def __init__(self, cfg: SearchConfig, *, inputs: RunInputs, progress: bool = False):
        self.cfg = cfg  # cfg.threads hold for the run (ropescale.runs.protocol.execute_run)
        self.device = resolve_device(cfg.device)
        self.docs, self.tokenizer = inputs.docs, inputs.tokenizer
        self.model = load_run_model(cfg.model, inputs, dtype=cfg.dtype, device=str(self.device), local_attention=True)
        self.train_length = loaded_window(self.model, f"model: {cfg.model}", cfg.original_max_position_embeddings,
                                          purpose="search")
        self.context = configured_context(cfg.model)  # DCA's defaults from the model's config, as the patch reads them
        sizes = [len(d) for d in self.docs]
        try:
            self.windows = {L: make_windows(sizes, L, max_windows=cfg.max_windows)
                            for L in sorted({*cfg.lengths, self.train_length})}
        except WindowError as e:
            raise ConfigError(f"data: {cfg.data.spec().describe()}: {e}") from None
        self.weights = dict(zip(cfg.lengths, cfg.weights()))
        self.passkeys = self._passkeys() if cfg.retrieval_weight > 0 else []
        self.needles = needle_examples(self.tokenizer, self.docs, length=max(cfg.lengths), trials=cfg.needle_trials,
                                       train_length=self.train_length) if cfg.needle_weight > 0 else []
        self.terms = {t.task: self._gold(t) for t in cfg.tasks}  # task → [(prompt ids, answer ids)]
        self.scorer = scoring_engine(cfg.engine)
        self.served = None  # an engine outside this process: the folder candidates are served from (``serve_from``)
        self.vanilla_ppl_train = math.exp(self._nll(self.train_length)) if self.scorer.in_process else None
        self.evaluations = 0

    def serve_from(self, output: Path) -> None:
        """An engine outside this process: serve the candidates from ``output`` (the claimed search folder:
        ``<output>/<engine>/candidate-<pid>/``, one per process, several may share a study) and measure the
        constraint's vanilla PPL at T through the engine, as every candidate will be. Nothing in process."""
        if self.scorer.in_process:
            return
        self.served = Path(output) / self.scorer.name / f"candidate-{os.getpid()}"
        self.requests, self.asked = self._requests()
        with patch(self.model, BASELINE, original_max_position_embeddings=self.train_length) as handle:
            self.vanilla_ppl_train = math.exp(self._measure_served(handle)["nll"][self.train_length])

    def _requests(self) -> tuple[list[dict], list[tuple]]:
        """The requests every candidate makes and, per request, what it is: ``("window", L, window)`` (its
        log-probabilities; the targets from ``score_from`` on are scored) or ``("answer", term, answer
        length)`` (prompt + answer; the answer's log-probabilities)."""
        reqs, what = [], []
        for length in sorted(self.windows):
            for w in self.windows[length]:
                reqs.append({"ids": self.docs[w.doc][w.start:w.end].tolist(), "max_tokens": 1, "prompt_logprobs": True})
                what.append(("window", length, w))
        pairs = [(term, list(ex.prompt.ids), list(ex.candidates[0]))
                 for term, examples in (("retrieval", self.passkeys), ("needle", self.needles)) for ex in examples]
        pairs += [(f"task:{name}", prompt, answer) for name, gold in self.terms.items() for prompt, answer in gold]
        for term, prompt, answer in pairs:
            reqs.append({"ids": prompt + answer, "max_tokens": 1, "prompt_logprobs": True})
            what.append(("answer", term, len(answer)))
        return reqs, what

    def _measure_served(self, handle) -> dict:
        """The candidate patched in as ``handle`` scored by the engine (see the module docstring): ``{"nll":
        {L: mean NLL}, "retrieval": …, "needle": … (None when not in the objective), "parity": |Δ mean NLL| of
        the first window of the longest length, None without a parity check}``. ``Refused`` for a candidate
        the engine cannot serve (its export's reason)."""
        from ropescale.serving.rope import ExportRefused

        if self.served is None:
            raise RuntimeError("SearchObjective: serve_from(folder) comes before a candidate an engine scores")
        cfg = self.cfg
        checked = next(i for i, w in enumerate(self.asked) if w[0] == "window" and w[1] == max(cfg.lengths))
        serving = Serving(handle=handle, model=self.model, tokenizer=self.tokenizer, source=cfg.model, dtype=cfg.dtype,
                          options=self.scorer.section(cfg), folder=self.served, log_dir=self.served.parent / "logs",
                          where=f"{handle.strategy} {handle.params}", device=self.device,
                          checked_what=f"the first window at {max(cfg.lengths)}", stops="the search stops")
        try:
            scored = self.scorer.score_requests(self.requests, checked, serving)
        except ExportRefused as e:
            raise Refused(f"{e} (engine: {self.scorer.name})") from None
        sums: dict = {}
        for r, (kind, key, item) in zip(scored.results, self.asked):
            logprobs = torch.tensor(r["logprobs"], dtype=torch.float64)  # [n - 1]: targets 1 … n-1
            # a window: the targets score_windows keeps, from score_from on; an answer: its tokens
            logprobs = logprobs[max(item.score_from - item.start - 1, 0):] if kind == "window" else logprobs[-item:]
            total, tokens = sums.get(key, (0.0, 0))
            sums[key] = (total - float(logprobs.sum()), tokens + logprobs.numel())
        mean = {k: total / tokens for k, (total, tokens) in sums.items()}
        return {"nll": {k: v for k, v in mean.items() if isinstance(k, int)}, "retrieval": mean.get("retrieval"),
                "needle": mean.get("needle"), "tasks": {name: mean[f"task:{name}"] for name in self.terms},
                "parity": None if scored.parity is None else scored.parity["mean_nll_diff"]}

    def _passkeys(self):
        from ..tasks.passkey import Passkey, PasskeyOptions

        n = self.cfg.retrieval_trials
        depths = [i / (n - 1) for i in range(n)] if n > 1 else [0.5]
        options = PasskeyOptions(depths=depths, trials=1, candidates=2, seed=RETRIEVAL_SEED)
        task = Passkey(options, tokenizer=self.tokenizer, train_length=self.train_length)
        return task.examples(max(self.cfg.lengths))

    def _gold(self, term) -> list[tuple[list[int], list[int]]]:
        """A ``TaskTerm``'s first ``trials`` gold answers at the longest length, on the search split's text."""
        from ..tasks.base import get_task

        cls = get_task(term.task)
        task = cls(term.task_options(), tokenizer=self.tokenizer, train_length=self.train_length,
                   documents=self.docs, source=self.cfg.data.spec().describe())
        try:
            gold = task.gold_answers(task.examples(max(self.cfg.lengths)))[:term.trials]
        except PromptError as e:  # no example fits the length: the search cannot start
            raise ConfigError(f"tasks: {term.task}: {e}") from None
        empty = [i for i, (_, answer) in enumerate(gold) if not answer]
        if empty:
            raise ConfigError(f"tasks: {term.task}'s gold answer {empty[0]} has no tokens to score")
        return gold

    @torch.no_grad()
    def _gold_nll(self, gold: list[tuple[list[int], list[int]]]) -> float:
        """Mean NLL per answer token of the gold answers (one full forward per prompt)."""
        from ..tasks.retrieval import candidate_scores_full

        total, tokens = 0.0, 0
        for prompt, answer in gold:
            total -= float(candidate_scores_full(self.model, prompt, [answer], self.device)[0])
            tokens += len(answer)
        return total / tokens

    def _nll(self, length: int) -> float:
        """Token-weighted mean NLL [nats per token] of the search windows of ``length`` tokens."""
        return self._score(length).mean_nll

    def _score(self, length: int, kl: bool = False):
        return score_windows(self.model, self.docs, self.windows[length], length=length, buckets=1,
                             device=self.device, kl=kl)

    def _retrieval_nll(self) -> float:
        """Mean NLL per answer token of the passkey answers (one full forward per prompt)."""
        return self._gold_nll([(ex.prompt.ids, ex.candidates[0]) for ex in self.passkeys])

    def check_candidate(self, sampled: dict) -> None:
        """The strategy's output for one candidate (``sampled``: its searched values) computed on the model
        and checked before the search claims its folder (``ropescale.runs.lifecycle.check_strategy``, a
        dynamic strategy also at the longest target length): a strategy whose output is not frequencies —
        NaN, a wrong shape, a list, a NaN attention factor — is refused now, in one line (``ConfigError``),
        not at the first trial after the manifest and the study were written. A candidate the strategy
        refuses by its parameters is not checked (its trials are pruned, ``Refused``)."""
        try:
            params = self.params(sampled)
        except ValueError:
            return
        try:
            check_strategy(self.model, self.cfg.strategy, length=max(self.cfg.lengths),
                           original_max_position_embeddings=self.train_length, **params)
        except InvalidInput as e:
            if type(e) is not InvalidInput:  # a refusal of its own kind, as it is
                raise
            raise ConfigError(f"strategy: {self.cfg.strategy}, computed on the model before the search: "
                              f"{' '.join(str(e).split())}") from None

    def params(self, sampled: dict) -> dict:
        """``spec_params`` of a sampled candidate for this model (target: the longest length)."""
        return spec_params(self.cfg.strategy, self.cfg.fixed, sampled, length=max(self.cfg.lengths),
                           train_length=self.train_length, context=self.context)

    def __call__(self, sampled: dict) -> tuple[dict, Measurement]:
        """Patch the candidate in, score it, patch it out. ``Refused`` when the strategy refuses
        its parameters (``spec_params``); any other error is not the candidate's and propagates."""
        try:
            params = self.params(sampled)
        except ValueError as e:
            raise Refused(str(e)) from None
        t0 = time.perf_counter()
        with patch(self.model, self.cfg.strategy, original_max_position_embeddings=self.train_length,
                   **params) as handle:
            got = self._measure_here() if self.scorer.in_process else self._measure_served(handle)
        nll, retrieval, needle, tasks = got["nll"], got["retrieval"], got["needle"], got["tasks"]
        ppl_train = math.exp(nll[self.train_length])
        self.evaluations += 1
        objective = sum(self.weights[L] * nll[L] for L in self.cfg.lengths)
        if retrieval is not None:
            objective += self.cfg.retrieval_weight * retrieval
        if needle is not None:
            objective += self.cfg.needle_weight * needle
        objective += sum(t.weight * tasks[t.task] for t in self.cfg.tasks)
        constraint = ppl_train / ((1 + self.cfg.epsilon) * self.vanilla_ppl_train) - 1
        kl = got.get("kl")
        if kl is not None:
            constraint = max(constraint, kl / self.cfg.max_kl - 1)
        nll = {L: nll[L] for L in self.cfg.lengths}
        return params, Measurement(objective=objective, nll=nll, ppl={L: math.exp(v) for L, v in nll.items()},
                                   ppl_train=ppl_train, constraint=constraint, retrieval_nll=retrieval,
                                   seconds=round(time.perf_counter() - t0, 3), needle_nll=needle,
                                   parity=got.get("parity"), kl_train=kl, task_nll=tasks or None)

    def _measure_here(self) -> dict:
        """The patched model's terms, scored in this process: mean NLL per length (the target
        lengths and T), the passkey and needle answers' (None when not in the objective)."""
        kl = self.cfg.max_kl is not None
        scores = {L: self._score(L, kl=kl and self.train_length == L) for L in self.windows}
        return {"nll": {L: s.mean_nll for L, s in scores.items()},
                "kl": scores[self.train_length].mean_kl if kl else None,
                "retrieval": self._retrieval_nll() if self.passkeys else None,
                "needle": answer_nll(self.model, self.needles, self.device) if self.needles else None,
                "tasks": {name: self._gold_nll(gold) for name, gold in self.terms.items()}}


class SearchRun(RunKind):
    """What both searches share as run kinds (``ropescale.runs.protocol``): their identity is the
    config's (``SearchConfig.identity``) with the search split's tokens, the split is refused when it
    holds a held-out document (``check_disjoint``), and their preparation builds the objective."""

    def __init__(self, cfg: SearchConfig, *, progress: bool = True):
        self.cfg, self.progress = cfg, progress

    def check_documents(self, texts: list[str]) -> None:
        check_disjoint(self.cfg, texts)

    def identity(self, inputs: RunInputs):
        return self.cfg.identity(), inputs.docs

    def prepare(self, inputs: RunInputs, folder: RunFolder | None) -> None:
        self.objective = SearchObjective(self.cfg, progress=self.progress, inputs=inputs)
