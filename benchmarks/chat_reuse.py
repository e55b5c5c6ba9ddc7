"""KV both ways: how much of a chat's last answer the next turn finds cached, 1P+1D.

    python -m benchmarks.chat_reuse [--model DIR] [--output-dir /tmp/bench]

A chat's next turn carries the last answer, whose KV the decode worker computed. With
`--save-answers` (the default) decode writes a finished answer's full blocks through to the
fleet store, where the next turn's prefill finds them; `--no-save-answers` is the baseline
(the prefill pool never sees the answer and recomputes it). Each setting runs under its own
`pdserve up` 1P+1D (the embedded default model unless `--model`), in the same run, and a
colocated worker for reference (one worker holds every answer in its own pool: what placing
each turn where its blocks are would reach at best):

- two-turn: turn 1 = `--prompt-len` random token ids, `--answer-len` tokens out; turn 2 =
  turn 1's prompt + its answer + `--new-len` new tokens, sent as soon as turn 1's stream
  ended. Token-id prompts through /v1/completions, so the answer's ids are exactly the
  generated ones. The API returns text, not ids, and a byte-level tokenizer's lone bytes all
  read as U+FFFD: answers are sampled from `allowed_token_ids` whose texts name one id each,
  so the ids are read back from the completion's logprob tokens.
- multi-turn: `--conversations` x `--turns`, each turn's prompt the whole history with every
  answer plus `--new-len` new tokens, conversations interleaved, one request at a time.
  Ideal = the history tokens whose KV exists somewhere in the fleet: the last prompt and
  all of the last answer but its final token (never fed forward), in whole blocks.
- chat-template: the two-turn chat through /v1/chat/completions with text; the answer's text
  is re-tokenized inside the next prompt's template, which may not give the generated ids.
  Reports where turn 2's template ids first differ from turn 1's prompt + generated answer,
  and the cached tokens the server reported.

Writes chat_reuse.json to the output folder, never the checkout.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.benchmarks import server_process
from pdserve.benchmarks.output import add_output_dir, output_dir

PORT = 18860
BLOCK = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint folder (default: the embedded default model)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--answer-len", type=int, default=128)
    parser.add_argument("--new-len", type=int, default=32,
                        help="new tokens of each later turn")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--multi-new-len", type=int, default=64,
                        help="multi-turn: new tokens a turn adds")
    parser.add_argument("--multi-answer-len", type=int, default=64)
    parser.add_argument("--up-args", default="", help="extra `pdserve up` flags")
    parser.add_argument("--seed", type=int, default=0)
    add_output_dir(parser, "chat_reuse")


RUNS = (("disagg", True), ("disagg", False), ("colocated", True))
"""(`pdserve up --mode`, --save-answers) of each run."""


def start(model: Path | None, mode: str, save_answers: bool, args: argparse.Namespace,
          log: Path) -> subprocess.Popen:
    pdserve = shutil.which("pdserve")
    command = [*([pdserve] if pdserve else [sys.executable, "-m", "pdserve.app.cli"]), "up",
               "--mode", mode, "--port",
               str(PORT), "--worker-base-port", str(PORT + 10), "--store-port",
               str(PORT + 30), "--save-answers" if save_answers else "--no-save-answers",
               *args.up_args.split()]
    if model is not None:
        command += ["--model", str(model)]
    return server_process.start(command, log, f"http://127.0.0.1:{PORT}/health", 300)


class Client:
    """Streamed requests to the router, each returning its answer and usage."""

    def __init__(self, http: httpx.Client, model: str, tokenizer) -> None:
        self.http, self.model = http, model
        self.token_ids: dict[str, list[int]] = {}  # a token's text -> the ids of that text
        for i in range(len(tokenizer)):
            self.token_ids.setdefault(tokenizer.decode([i]), []).append(i)
        special = set(tokenizer.all_special_ids)
        self.allowed = sorted(ids[0] for text, ids in self.token_ids.items()
                              if len(ids) == 1 and text and ids[0] not in special)
        """What answers are sampled from: ids that the logprob tokens' texts name."""

    def stream(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        body = {"model": self.model, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True},
                "allowed_token_ids": self.allowed, **body}
        sent = time.perf_counter()
        ttft, text, tokens, usage = None, "", [], None
        with self.http.stream("POST", f"http://127.0.0.1:{PORT}{path}", json=body) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}: {reply.read()[:300]!r}")
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    if ttft is None:
                        ttft = time.perf_counter() - sent
                    text += choice.get("text") or (choice.get("delta") or {}).get("content") \
                        or ""
                    logprobs = choice.get("logprobs") or {}
                    tokens += logprobs.get("tokens") or [
                        item["token"] for item in logprobs.get("content") or []]
                usage = chunk.get("usage") or usage
        if ttft is None or usage is None:
            raise RuntimeError("a stream without a token or without usage")
        return {"ttft_s": ttft, "text": text, "tokens": tokens,
                "prompt_tokens": usage["prompt_tokens"],
                "completion_tokens": usage["completion_tokens"],
                "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}

    def complete(self, prompt: list[int], max_tokens: int) -> tuple[list[int], dict]:
        """A token-id completion: (the answer's ids, the reply)."""
        reply = self.stream("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                "logprobs": 0})
        return self.answer_ids(reply), reply

    def answer_ids(self, reply: dict[str, Any]) -> list[int]:
        """The generated ids, from the logprob tokens' texts (each names one id)."""
        if len(reply["tokens"]) != reply["completion_tokens"]:
            raise RuntimeError("a logprob token per generated token was expected")
        ids = []
        for token in reply["tokens"]:
            candidates = self.token_ids.get(token, [])
            if len(candidates) != 1:
                raise RuntimeError(f"token text {token!r} names {len(candidates)} ids")
            ids.append(candidates[0])
        return ids


def ideal_cached(history: list[int], prompt_len: int) -> int:
    """What the fleet can hold of a turn's prompt: the earlier turns' tokens with KV (all
    but the last answer's final token), in whole blocks, one token left to compute."""
    return min((len(history) - 1) // BLOCK, (prompt_len - 1) // BLOCK) * BLOCK


def two_turn(client: Client, rng: random.Random, vocab: int, args: argparse.Namespace
             ) -> dict[str, Any]:
    prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
    answer, first = client.complete(prompt, args.answer_len)
    turn_2 = prompt + answer + [rng.randrange(3, vocab) for _ in range(args.new_len)]
    _, second = client.complete(turn_2, 8)
    return {"turn_1_cached": first["cached"], "turn_2_prompt_tokens": second["prompt_tokens"],
            "turn_2_cached": second["cached"],
            "turn_2_ideal": ideal_cached(prompt + answer, len(turn_2)),
            "turn_2_ttft_s": second["ttft_s"]}


def multi_turn(client: Client, rng: random.Random, vocab: int, args: argparse.Namespace
               ) -> dict[str, Any]:
    histories: list[list[int]] = [[] for _ in range(args.conversations)]
    rows = []
    for turn in range(1, args.turns + 1):
        for conversation, history in enumerate(histories):
            ideal = ideal_cached(history, len(history) + args.multi_new_len) if history else 0
            history += [rng.randrange(3, vocab) for _ in range(args.multi_new_len)]
            answer, reply = client.complete(list(history), args.multi_answer_len)
            rows.append({"turn": turn, "conversation": conversation,
                         "prompt_tokens": reply["prompt_tokens"], "cached": reply["cached"],
                         "ideal": ideal, "ttft_s": reply["ttft_s"]})
            history += answer
    later = [r for r in rows if r["turn"] > 1]
    return {"rows": rows, "cached": sum(r["cached"] for r in later),
            "ideal": sum(r["ideal"] for r in later),
            "mean_ttft_later_s": sum(r["ttft_s"] for r in later) / len(later)}


def chat_template(client: Client, tokenizer, rng: random.Random, args: argparse.Namespace
                  ) -> dict[str, Any]:
    """The two-turn chat with text messages: does the answer keep its ids in turn 2?"""
    words = [w for w in tokenizer.get_vocab() if w.isalpha()]
    user_1 = " ".join(rng.choice(words) for _ in range(args.prompt_len // 2))
    user_2 = " ".join(rng.choice(words) for _ in range(args.new_len // 2))
    messages = [{"role": "user", "content": user_1}]
    prompt_ids = client.http.post(f"http://127.0.0.1:{PORT}/tokenize", json={
        "model": client.model, "messages": messages,
        "add_generation_prompt": True}).json()["tokens"]
    first = client.stream("/v1/chat/completions", {
        "messages": messages, "max_tokens": args.answer_len, "logprobs": True})
    answer_ids = client.answer_ids(first)
    messages += [{"role": "assistant", "content": first["text"]},
                 {"role": "user", "content": user_2}]
    turn_2_ids = client.http.post(f"http://127.0.0.1:{PORT}/tokenize", json={
        "model": client.model, "messages": messages,
        "add_generation_prompt": True}).json()["tokens"]
    second = client.stream("/v1/chat/completions", {"messages": messages, "max_tokens": 8})
    generated = prompt_ids + answer_ids
    same = next((i for i, (a, b) in enumerate(zip(generated, turn_2_ids, strict=False))
                 if a != b), min(len(generated), len(turn_2_ids)))
    return {"turn_1_prompt_tokens": len(prompt_ids), "answer_tokens": len(answer_ids),
            "answer_text_roundtrip_equal": tokenizer.encode(
                first["text"], add_special_tokens=False) == answer_ids,
            "first_differing_position": same, "matching_blocks": same // BLOCK,
            "turn_2_prompt_tokens": second["prompt_tokens"], "turn_2_cached": second["cached"],
            "turn_2_ideal": ideal_cached(generated, len(turn_2_ids))}


def run_one(model: Path | None, model_dir: Path, mode: str, save_answers: bool,
            args: argparse.Namespace, out: Path, tokenizer) -> dict[str, Any]:
    rng = random.Random(args.seed)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    process = start(model, mode, save_answers, args,
                    out / f"serve-{mode}-save-answers-{save_answers}.log")
    try:
        with httpx.Client(timeout=300) as http:
            served = http.get(f"http://127.0.0.1:{PORT}/v1/models").json()["data"][0]["id"]
            client = Client(http, served, tokenizer)
            client.complete([rng.randrange(3, vocab) for _ in range(32)], 4)  # warm-up
            result = {"mode": mode, "save_answers": save_answers,
                      "two_turn": two_turn(client, rng, vocab, args),
                      "multi_turn": multi_turn(client, rng, vocab, args),
                      "chat_template": chat_template(client, tokenizer, rng, args)}
            time.sleep(1.5)  # a status heartbeat after the last request
            workers = http.get(f"http://127.0.0.1:{PORT}/status").json()["workers"]
            result["answer_blocks"] = {
                name: sum((w.get("kv_transfer") or {}).get(f"answer_{name}_blocks", 0)
                          for w in workers) for name in ("saved", "dropped")}
    finally:
        server_process.stop(process)
    return result


def summarize(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        two, multi, chat = r["two_turn"], r["multi_turn"], r["chat_template"]
        print(f"\n{r['mode']} --{'' if r['save_answers'] else 'no-'}save-answers")
        print(f"  two-turn: turn 2 cached {two['turn_2_cached']} of "
              f"{two['turn_2_prompt_tokens']} (ideal {two['turn_2_ideal']}), TTFT "
              f"{1e3 * two['turn_2_ttft_s']:.1f} ms")
        print(f"  multi-turn: cached {multi['cached']} / ideal {multi['ideal']} = "
              f"{multi['cached'] / max(multi['ideal'], 1):.3f}, mean TTFT turns 2.. "
              f"{1e3 * multi['mean_ttft_later_s']:.1f} ms")
        print(f"  chat template: ids equal up to position {chat['first_differing_position']} "
              f"({chat['matching_blocks']} blocks; turn 1 prompt {chat['turn_1_prompt_tokens']}"
              f" + answer {chat['answer_tokens']}), answer text round-trips to its ids: "
              f"{chat['answer_text_roundtrip_equal']}; turn 2 cached {chat['turn_2_cached']}"
              f" of {chat['turn_2_prompt_tokens']} (ideal {chat['turn_2_ideal']})")
        print(f"  answer blocks written through: {r['answer_blocks']}")


def machine() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    if args.model:
        model, model_dir = Path(args.model), Path(args.model)
    else:
        from pdserve.serve.default_model import default_model_dir

        model, model_dir = None, default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = output_dir(args, "chat_reuse")
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for mode, save_answers in RUNS:
        runs.append(run_one(model, model_dir, mode, save_answers, args, out, tokenizer))
        time.sleep(2)
    summarize(runs)
    result = {"machine": machine(), "model": str(model_dir), "args": {
        k: v for k, v in vars(args).items() if k != "output_dir"}, "runs": runs}
    (out / "chat_reuse.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out / 'chat_reuse.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
