"""`benchmarks/peer_step.py` / `python -m pdserve.benchmarks.peer_step`: runs
benchmarks/experiments/peer_step.py, where it moved (by path: vLLM's venv has no pdserve)."""
import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).parent / "experiments" / "peer_step.py"), run_name="__main__")
