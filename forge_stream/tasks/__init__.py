"""The shipped task suite (seeded families, graders, train/held-out split) and its scripted teacher."""

from forge_stream.tasks.suite import DOMAINS, SYSTEM, TOOLS, iter_tasks, make_tasks, split_of

__all__ = ["DOMAINS", "SYSTEM", "TOOLS", "iter_tasks", "make_tasks", "split_of"]
