"""Evaluation tasks, one module each (``perplexity``, ``passkey``, ``needle``, ``niah_multikey``),
sharing one lifecycle (``base.Task``); a module dropped here registers itself and is found by name."""

from .base import TASKS, Metric, Task, TaskOptions, UnknownTaskError, get_task, task_names

__all__ = ["TASKS", "Metric", "Task", "TaskOptions", "UnknownTaskError", "get_task", "task_names"]
