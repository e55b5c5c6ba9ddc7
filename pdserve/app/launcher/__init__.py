"""`pdserve up`: a whole cluster on one host, for a first look and for end-to-end tests.

Starts the KV store, the workers (prefill + decode, or colocated) and the router as child
processes on loopback, and supervises them until Ctrl-C. Each role is an ordinary
`pdserve <role>` command, so the same flags run one role per machine in a real cluster.

    up.py           the command: its flags, the run that starts and watches the cluster
    commands.py     each child's command line, from the flags (plan)
    placement.py    which GPUs and cores each worker gets
    supervision.py  the children, restarts (RestartPolicy, Supervisor), standbys, stop and kill
"""

from __future__ import annotations

from pdserve.app.launcher.commands import plan
from pdserve.app.launcher.placement import (
    assign_gpus,
    lend_idle_cores,
    place_on_cores,
    share_with_services,
    split_cores,
    visible_gpus,
)
from pdserve.app.launcher.supervision import (
    Child,
    Cluster,
    RestartPolicy,
    RoleKeepsFailing,
    Supervisor,
    activate,
    spawn,
    start_from,
    stop_standby,
)
from pdserve.app.launcher.up import add_arguments, provide_cluster_key, run

__all__ = [
    "Child",
    "Cluster",
    "RestartPolicy",
    "RoleKeepsFailing",
    "Supervisor",
    "activate",
    "add_arguments",
    "assign_gpus",
    "lend_idle_cores",
    "place_on_cores",
    "plan",
    "provide_cluster_key",
    "run",
    "share_with_services",
    "spawn",
    "start_from",
    "split_cores",
    "stop_standby",
    "visible_gpus",
]
