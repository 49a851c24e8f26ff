"""The results record: one JSON object per line of ``results.jsonl``, one per (strategy, length)
cell, key by key (in the spirit of lm-eval's ``result_schema.py``).

``schema`` is the version of this layout (2; records without it were written by ropescale 0.1,
which had only the perplexity task and no manifest). The task's own metrics follow the common
keys: perplexity writes ``ppl``, ``nll``, ``tokens``, ``windows``, ``mode``, ``stride``,
``add_bos``, ``dynamic`` and ``nll_by_position`` (a list of ``{start, end, tokens, nll}``); the
retrieval tasks write ``accuracy``, ``accuracy_ci``, ``candidate_accuracy``,
``candidate_accuracy_ci``, ``trials``, ``chance``, ``prompt_tokens`` and ``by_depth`` (a list of
``{depth, needle_token, trials, accuracy, accuracy_ci, candidate_accuracy,
candidate_accuracy_ci}``). Intervals are 95% Wilson score intervals ``[low, high]``.

``rotation`` (static frequency strategies): the fingerprint of the rotation the patch left on the model
(``ropescale.runs.lifecycle.rotation_fingerprint``); a later cell whose patch rotates bit for bit the same
at the same length is not run again: its record carries the measured one's numbers and ``same_as``, the
measured cell's strategy (``vanilla`` for ``linear`` at factor 1 inside the window).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SCHEMA_VERSION", "Record"]

SCHEMA_VERSION = 2


class Record(BaseModel):
    """The keys every record has (extra keys: the task's metrics, listed above)."""

    model_config = ConfigDict(extra="allow")
    schema_version: int = Field(1, alias="schema", description="layout version; absent (1) before manifests")
    cell: str = Field(description="cell id: hash of the experiment identity, strategy, params, logn and length")
    experiment: str | None = Field(None, description="hash of the experiment identity in manifest.json")
    task: str = Field("perplexity", description="task name (absent before tasks existed: perplexity)")
    strategy: str = Field(description="display name: name[:k=v,...][+logn] or the config's label")
    name: str = Field(description="registered strategy name")
    params: dict[str, Any] = Field(description="resolved strategy parameters, sweep-filled ones included")
    logn: bool = Field(description="log-n query scaling on")
    length: int = Field(description="L: window / example length in tokens")
    train_length: int = Field(description="T: the training window the strategies scale from [tokens]")
    model: str = Field(description="model as given: bundled name, local path or hub id")
    data: str | None = Field(None, description="data source (tasks that read text), with [:max_documents]")
    options: dict[str, Any] | None = Field(None, description="the task's options that change its numbers")
    dtype: str
    device: str
    note: str | None = Field(None, description="a caveat about this cell (e.g. a truncation window beyond L)")
    seconds: float = Field(description="wall time of the cell [s]")
    env: dict[str, Any] = Field(description="ropescale, torch, transformers, python versions; git hash; threads")
