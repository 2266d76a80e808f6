"""Launchers: ``flashckpt-run`` (:mod:`flashckpt_integrations.launcher.run`), torchrun on torch
elastic's agent that hosts the node's saver, reports failing ranks, persists the newest
in-memory step when a worker fails or the job is stopped, and restarts workers that resume
from memory.

Modules are imported on use: importing this package imports nothing else.
"""
