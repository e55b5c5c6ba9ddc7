"""A role process freezes what startup built out of the cyclic garbage collector
(pdserve/lifecycle.py, freeze_startup_heap): its full collections then walk only what serving
made, and garbage made after the freeze is still collected. In a child process, so this
test session's heap is left alone."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import gc, json
    from pdserve.lifecycle import freeze_startup_heap

    startup = [[i] for i in range(50_000)]  # tracked objects startup built
    frozen = freeze_startup_heap("test")
    tracked_after = len(gc.get_objects())
    cycle = []
    cycle.append(cycle)  # garbage made while serving
    del cycle
    print(json.dumps({"frozen": frozen, "count": gc.get_freeze_count(),
                      "tracked_after": tracked_after, "collected": gc.collect(),
                      "startup_alive": len(startup)}))
""")


def test_startup_objects_are_frozen_and_later_garbage_is_still_collected():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["frozen"] == report["count"] > 50_000
    assert report["tracked_after"] < 10_000  # the frozen ones are not walked any more
    assert report["collected"] >= 1 and report["startup_alive"] == 50_000
