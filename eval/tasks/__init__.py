"""Evaluation tasks, one module each (``perplexity``, ``passkey``, ``needle``), sharing one
lifecycle (``eval.tasks.base.Task``); a module dropped here is found by name."""

from .base import TASKS, Metric, Task, TaskOptions, UnknownTaskError, get_task, task_names

__all__ = ["TASKS", "Metric", "Task", "TaskOptions", "UnknownTaskError", "get_task", "task_names"]
