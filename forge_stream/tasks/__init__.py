"""The shipped task suite (seeded families, graders, train / validation / test splits) and its scripted teacher."""

from forge_stream.tasks.suite import DOMAINS, SPLITS, SYSTEM, TOOLS, iter_tasks, make_tasks, split_of, template_key

__all__ = ["DOMAINS", "SPLITS", "SYSTEM", "TOOLS", "iter_tasks", "make_tasks", "split_of", "template_key"]
