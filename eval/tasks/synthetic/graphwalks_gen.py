"""OpenAI's GraphWalks, generated (dataset card ``openai/graphwalks``, MIT). The card publishes rows, not its
generator; this one is written from the rows' format, at the card's revision of 2026-02-27 (the BFS operation asks
for the nodes "at exactly depth N"; the example block has four operations):

- **Prompt**: ``HEAD`` (the task, a four-edge example with two BFS and two parents operations, each with its final
  answer), the graph's edges ``"{src} -> {dst}"`` one a line, then ``"\\n\\n\\nOperation:\\n{operation}\\n"`` and
  ``TAIL`` (reason step by step, then ``Final Answer: [...]`` on the last line; ``[]`` for the empty set) —
  transcribed from released rows, byte for byte (``tests/data/graphwalks/rows.json`` holds them and the test checks
  this rendering against them).
- **Graph**: nodes ``md5(str(i)).hexdigest()[:10]`` for i = 0 … n−1; every node has the graph's out-degree k, each
  edge's target drawn uniformly from all n nodes (self-loops and repeated edges occur, as in the released rows); the
  edges grouped by source in node order.
- **Operations**: ``bfs`` — "Perform a BFS from node X and return only the nodes at exactly depth d (not nodes at
  intermediate depths)."; the answer is the nodes whose shortest distance from X is d. ``parents`` — "Find the
  parents of node X."; the answer is every node with an edge to X, X itself excepted (the card's instruction: "do not
  return the given node itself"). X is uniform over the nodes, d uniform over ``depths``; answers sorted.
- **Size**: the node count fills L with the model's tokenizer (``base.fill``). The card's rows are 2.6k to 1.75M
  characters; its BFS depths, out-degrees and the share of empty answers are not published: here they are options.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from ..prompts import PromptError
from ..ruler.spec import RulerSample
from .base import fill, sample_rng

__all__ = ["BFS", "HEAD", "PARENTS", "TAIL", "GraphDraft", "bfs_at_depth", "draw_graph", "generate_graphwalks",
           "node_id", "parents_of", "render_prompt"]

Problem = Literal["bfs", "parents"]

HEAD = (
    "\nYou will be given a graph as a list of directed edges. All nodes are at least degree 1. You will also get a "
    "description of an operation to perform on the graph.\nYour job is to execute the operation on the graph and "
    "return the set of nodes that the operation results in. If asked for a breadth-first search (BFS), only return "
    "the nodes that are both reachable and exactly at that depth (not nodes at intermediate depths), and do not "
    "return the starting node. If asked for the parents of a node, only return the nodes that have an edge leading "
    "to the given node, do not return the given node itself.\n\nHere is an example:\n<begin example>\n\nThe graph "
    "has the following edges:\nuvwx -> alke\nabcd -> uvwx\nabcd -> efgh\nefgh -> uvwx\n\nExample 1:\nOperation:\n"
    "Perform a BFS from node abcd and return only the nodes at exactly depth 1 (not nodes at intermediate depths).\n"
    "Final Answer: [uvwx, efgh]\n\nExample 2:\nOperation:\nPerform a BFS from node alke and return only the nodes at "
    "exactly depth 1 (not nodes at intermediate depths).\nFinal Answer: []\n\nExample 3:\nOperation:\nFind the "
    "parents of node uvwx.\nFinal Answer: [abcd, efgh]\n\nExample 4:\nOperation:\nFind the parents of node abcd.\n"
    "Final Answer: []\n\n<end example>\nHere is the graph to operate on:\nThe graph has the following edges:\n")
TAIL = (
    "\nYou should reason through the operation step by step, and then return the set of nodes that the operation "
    "results in. Return your final answer as a list of nodes in the very last line of your response. For example, "
    "if the operation returns the set of nodes [node1, node2, node3], your response should be:\nFinal Answer: "
    "[node1, node2, node3]\nIf the operation returns the empty set, your response should be:\nFinal Answer: []\n")
BFS = "Perform a BFS from node {node} and return only the nodes at exactly depth {depth} (not nodes at intermediate " \
      "depths)."
PARENTS = "Find the parents of node {node}."


@lru_cache(maxsize=1 << 20)
def node_id(i: int) -> str:
    """Node ``i``'s id: the first 10 hex digits of the MD5 of ``str(i)``."""
    return hashlib.md5(str(i).encode()).hexdigest()[:10]


def render_prompt(edges: Iterable[tuple[str, str]], operation: str) -> str:
    """The card's prompt for an edge list (in the order given) and an operation line."""
    lines = "\n".join(f"{s} -> {t}" for s, t in edges)
    return f"{HEAD}{lines}\n\n\nOperation:\n{operation}\n{TAIL}"


def bfs_at_depth(edges: Iterable[tuple[str, str]], start: str, depth: int) -> set[str]:
    """The nodes whose shortest directed distance from ``start`` is exactly ``depth`` (≥ 1: never ``start``)."""
    out = defaultdict(list)
    for s, t in edges:
        out[s].append(t)
    seen, frontier = {start}, {start}
    for _ in range(depth):
        frontier = {t for s in frontier for t in out[s] if t not in seen}
        if not frontier:  # nothing further: every deeper level is empty too (depths: [10**9] ran 10**9 empty steps)
            break
        seen |= frontier
    return frontier


def parents_of(edges: Iterable[tuple[str, str]], node: str) -> set[str]:
    """Every node with an edge to ``node``, ``node`` itself excepted."""
    return {s for s, t in edges if t == node and s != node}


@dataclass(frozen=True)
class GraphDraft:
    """One drawn sample: the graph (``targets[i]``: node i's out-edges' targets, node indices), the operation
    (``problem``, the asked node's index ``node``, the BFS ``depth``, 0 for parents) and its sorted ``answer``."""

    targets: list[list[int]]
    problem: Problem
    node: int
    depth: int
    answer: tuple[str, ...]

    @property
    def edges(self) -> list[tuple[str, str]]:
        """The edge list as the prompt holds it: node ids, grouped by source in node order."""
        return [(node_id(s), node_id(t)) for s, ts in enumerate(self.targets) for t in ts]

    @property
    def prompt(self) -> str:
        """What the model reads."""
        x = node_id(self.node)
        op = BFS.format(node=x, depth=self.depth) if self.problem == "bfs" else PARENTS.format(node=x)
        return render_prompt(self.edges, op)

    def sample(self, length: int) -> RulerSample:
        """As a cached sample: ``index`` = the BFS depth (0: a parents operation), ``outputs`` = the answer's nodes
        (sorted; none for the empty set), ``length`` = the prompt's tokens with the budget, no answer prefix."""
        return RulerSample(self.depth, self.prompt, self.answer, length, "")


def _answer(targets: list[list[int]], problem: Problem, node: int, depth: int) -> tuple[str, ...]:
    edges = [(s, t) for s, ts in enumerate(targets) for t in ts]
    found = bfs_at_depth(edges, node, depth) if problem == "bfs" else parents_of(edges, node)
    return tuple(sorted(node_id(i) for i in found))


def draw_graph(seed: int, length: int, index: int, nodes: int, *, out_degree: int, problem: Problem,
               depths: list[int], empty_answers: bool = True) -> GraphDraft:
    """Sample ``index`` at ``length`` with ``nodes`` nodes (its own stream: ``base.sample_rng("graphwalks", …)``):
    the targets of node 0's ``out_degree`` edges, node 1's, …, then the asked node (and depth); with
    ``empty_answers`` False the operation is drawn again, up to 100 times, while its answer is empty."""
    rng = sample_rng("graphwalks", seed, length, index)
    targets = [[rng.randrange(nodes) for _ in range(out_degree)] for _ in range(nodes)]
    for _ in range(100):
        node = rng.randrange(nodes)
        depth = rng.choice(depths) if problem == "bfs" else 0
        answer = _answer(targets, problem, node, depth)
        if answer or empty_answers:
            break
    return GraphDraft(targets, problem, node, depth, answer)


def generate_graphwalks(*, total: Callable[[str], int], length: int, num_samples: int, seed: int, out_degree: int,
                        problems: list[Problem], depths: list[int], empty_answers: bool) -> list[RulerSample]:
    """The samples of a length: sample i asks ``problems[i % len(problems)]``.

    Args:
        total: a prompt's tokens as the model reads them, with the generation budget.
        length: L [tokens].
        num_samples: how many samples.
        seed: the run's seed.
        out_degree: edges per node.
        problems: the operations, in turn.
        depths: the BFS depths drawn from.
        empty_answers: whether an operation may have the empty set as its answer.

    Returns:
        The samples (``GraphDraft.sample``).

    Raises:
        PromptError: no sample fits L, two of its nodes share an id, or (``empty_answers`` False) a sample's answer
            is empty in every one of its draws.
    """
    def draw(i: int, n: int) -> GraphDraft:
        return draw_graph(seed, length, i, n, out_degree=out_degree, problem=problems[i % len(problems)],
                          depths=depths, empty_answers=empty_answers)

    what = f"graphwalks at {length} tokens"
    out = fill(draw, lambda d: total(d.prompt), num_samples=num_samples, limit=length, lower=2, what=what,
               smallest=f"two nodes of out-degree {out_degree} and the operation")
    empty = [(i, d) for i, (d, _) in enumerate(out) if not d.answer]
    if empty and not empty_answers:  # draw_graph gave up after 100 draws: no non-empty answer at these depths
        i, d = empty[0]
        op = f"bfs at depth {d.depth}" if d.problem == "bfs" else "parents"
        raise PromptError(f"{what}: empty_answers is false but sample {i} ({op}) drew an empty answer 100 times over; "
                          f"ask smaller depths (given {depths}) or allow empty_answers")
    n = max(len(d.targets) for d, _ in out)
    if len({node_id(i) for i in range(n)}) < n:
        raise PromptError(f"{what}: {n} nodes: two node ids (md5(str(i))[:10]) coincide; take a shorter length")
    return [d.sample(tokens) for d, tokens in out]
