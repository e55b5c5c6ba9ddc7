"""Run vLLM (its CPU build, in its own venv) with pdserve's KV connector, for the tests.

Imported by tests (pdserve's venv): `vllm_python()` finds vLLM's interpreter and
`run_vllm(...)` runs this file there as a script, which generates greedily for token-id
prompts and writes the texts, token ids and cached-token counts (and vLLM's block size) as
JSON.

vLLM's venv does not have pdserve installed, so `pdserve_overlay()` builds a directory for its
PYTHONPATH holding the repository's pdserve/ (as a symlink) and msgpack (the one pdserve
dependency vLLM lacks), taken from pdserve's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# runs as a script in vLLM's venv too, where the tests' helpers package is not importable
REPO = Path(__file__).resolve().parents[2]
CONNECTOR_MODULE = "pdserve.integrations.vllm_connector"


def vllm_python() -> str | None:
    """vLLM's python (PDSERVE_VLLM_PYTHON, else /tmp/vllm-peer's), None when absent."""
    path = os.environ.get("PDSERVE_VLLM_PYTHON", "/tmp/vllm-peer/bin/python")
    return path if os.path.exists(path) else None


def pdserve_overlay(out_dir: Path) -> Path:
    """A PYTHONPATH entry importing pdserve (pdserve.kvstore included) and msgpack."""
    import msgpack

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pdserve").symlink_to(REPO / "pdserve")
    (out_dir / "msgpack").symlink_to(Path(msgpack.__file__).parent)
    return out_dir


def vllm_env(overlay: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a vLLM process that imports pdserve through `overlay`."""
    env = dict(os.environ, PYTHONPATH=str(overlay), VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", **(extra or {}))
    for name in ("VIRTUAL_ENV", "PYTHONHOME"):  # vLLM's interpreter, not pdserve's venv
        env.pop(name, None)
    return env


def run_vllm_code(python: str, overlay: Path, code: str, timeout_s: float = 300.0
                  ) -> subprocess.CompletedProcess:
    """Run a short script under vLLM's python (no engine: vLLM's ops and pdserve's code)."""
    # in the overlay: `-c` puts the working directory first on sys.path
    return subprocess.run([python, "-c", code], capture_output=True, text=True,
                          env=vllm_env(overlay), timeout=timeout_s, cwd=overlay)


def run_vllm(python: str, overlay: Path, model_dir: Path, prompts: list[list[int]],
             out_json: Path, max_tokens: int, role: str | None = None,
             extra_config: dict | None = None, env: dict[str, str] | None = None,
             timeout_s: float = 900.0) -> dict:
    """Run this file under vLLM's python: {"block_size": vLLM's, "outputs": one dict per
    prompt (text, token_ids, num_cached_tokens)}."""
    prompts_json = out_json.with_suffix(".prompts.json")
    prompts_json.write_text(json.dumps(prompts))
    argv = [python, __file__, "--model", str(model_dir), "--prompts", str(prompts_json),
            "--out", str(out_json), "--max-tokens", str(max_tokens)]
    if role is not None:
        argv += ["--kv-role", role, "--extra-config", json.dumps(extra_config or {})]
    log = out_json.with_suffix(".log")
    with open(log, "wb") as f:
        done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT,
                              env=vllm_env(overlay, env), timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM run failed ({done.returncode}):\n"
                           f"{log.read_text(errors='replace')[-6000:]}")
    return json.loads(out_json.read_text())


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-role", default=None)
    parser.add_argument("--extra-config", default="{}")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv_transfer_config = None
    if args.kv_role is not None:
        kv_transfer_config = KVTransferConfig(
            kv_connector="PdserveConnector", kv_connector_module_path=CONNECTOR_MODULE,
            kv_role=args.kv_role, kv_load_failure_policy="recompute",
            kv_connector_extra_config=json.loads(args.extra_config))
    llm = LLM(model=args.model, dtype="float32", max_model_len=1024, seed=0,
              kv_transfer_config=kv_transfer_config, disable_log_stats=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(Path(args.prompts)
                                                                        .read_text())]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    Path(args.out).write_text(json.dumps({
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        "outputs": [{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids),
                     "num_cached_tokens": o.num_cached_tokens or 0} for o in outputs]}))
    del llm


if __name__ == "__main__":
    sys.exit(_main())
