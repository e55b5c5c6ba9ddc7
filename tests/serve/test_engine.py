"""End to end: the engine's greedy tokens equal Hugging Face generate, token for token.

Tiny fp32 models from conftest. Every test ends with every KV block free and the block
manager's integrity check passing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.engine_util import prefill_engine

from pdserve.serve import LLM, SamplingParams
from pdserve.serve.config import CacheConfig, ModelConfig
from pdserve.serve.engine.engine import Engine
from pdserve.serve.engine.request import RequestOutput
from pdserve.serve.engine.roles import DecodeRole
from pdserve.serve.engine.scheduler import RequestRejectedError

PROMPT_LENGTHS = [1, 2, 5, 16, 17, 40, 64, 100]
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """HF generate(do_sample=False), one prompt at a time (no padding), stopping at eos."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(scope="module")
def reference(llama_dir: Path, qwen2_dir: Path):
    """arch -> (model dir, prompts, HF greedy outputs), computed once per module."""
    cache: dict[str, tuple[Path, list[list[int]], list[list[int]]]] = {}

    def get(arch: str):
        if arch not in cache:
            model_dir = {"llama": llama_dir, "qwen2": qwen2_dir}[arch]
            from transformers import AutoTokenizer

            prompts = make_prompts(len(AutoTokenizer.from_pretrained(str(model_dir))))
            cache[arch] = (model_dir, prompts, hf_greedy(model_dir, prompts))
        return cache[arch]

    return get


def assert_all_free(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert engine.stats().kv_usage == 0.0
    bm.check_integrity()


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_hf(reference, arch: str) -> None:
    model_dir, prompts, expected = reference(arch)
    with LLM(model_dir, num_kv_blocks=128) as llm:
        outputs = llm.generate(prompts, GREEDY)
        assert token_ids(outputs) == expected
        for out, ref, prompt in zip(outputs, expected, prompts, strict=True):
            assert out.prompt_token_ids == prompt and out.finished
            eos_stopped = ref[-1] in llm.engine.spec.eos_token_ids
            assert out.outputs[0].finish_reason == ("stop" if eos_stopped else "length")
            assert out.outputs[0].text == llm.tokenizer.decode(
                ref[:-1] if eos_stopped else ref, skip_special_tokens=True)
        assert_all_free(llm.engine)


@pytest.mark.parametrize(("arch", "block_size", "max_num_batched_tokens"),
                         [("llama", 8, 16), ("llama", 16, 7), ("llama", 32, 24),
                          ("qwen2", 8, 5)])
def test_chunked_prefill_and_block_sizes_match_hf(reference, arch: str, block_size: int,
                                                  max_num_batched_tokens: int) -> None:
    model_dir, prompts, expected = reference(arch)
    with LLM(model_dir, block_size=block_size, num_kv_blocks=4096 // block_size,
             max_num_batched_tokens=max_num_batched_tokens) as llm:
        assert token_ids(llm.generate(prompts, GREEDY)) == expected
        assert_all_free(llm.engine)


def test_preemption_gives_the_same_tokens(reference) -> None:
    model_dir, prompts, expected = reference("llama")
    # the longest request needs ceil((100 + 32 - 1) / 8) = 17 blocks; the batch needs ~60
    with LLM(model_dir, block_size=8, num_kv_blocks=20, enable_prefix_caching=False) as llm:
        assert token_ids(llm.generate(prompts, GREEDY)) == expected
        assert llm.engine.stats().num_preemptions > 0
        assert_all_free(llm.engine)


def test_prefix_caching_reuses_blocks_and_keeps_output(reference) -> None:
    model_dir, prompts, _ = reference("llama")
    shared = prompts[-1][:48]  # three full blocks of 16
    first, second = shared + [7, 8, 9], shared + [11, 12, 13, 14]
    expected = hf_greedy(model_dir, [first, second])
    with LLM(model_dir, num_kv_blocks=64) as llm:
        out_first = llm.generate(first, GREEDY)[0]
        assert out_first.num_cached_tokens == 0
        engine, bm = llm.engine, llm.engine.block_manager
        cached_before = set(bm._cached)
        assert len(cached_before) >= 3
        request = engine.add_request(second, GREEDY, request_id="second")
        outputs = engine.step()
        table = bm.block_table("second")
        assert set(table[:3]) <= cached_before  # the shared prefix: no new blocks
        assert not set(table[3:]) & cached_before  # only the tail is new
        assert request.num_cached_tokens == 48
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert [t for o in outputs for t in o.outputs[0].token_ids] == expected[1]
        assert outputs[-1].num_cached_tokens == 48
        stats = engine.stats()
        assert (stats.num_prefix_hit_tokens, stats.num_prefix_queried_tokens) == \
            (48, len(first) + len(second))
        assert out_first.outputs[0].token_ids == expected[0]
        assert_all_free(engine)


def test_streaming_deltas_stop_strings_and_abort(llama_dir: Path) -> None:
    with LLM(llama_dir, num_kv_blocks=64) as llm:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        full = llm.generate("def main():", params)[0].outputs[0]
        stop_str = full.text[5:9]
        cut = full.text.index(stop_str)
        engine.add_request("def main():", SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, stop=[stop_str]), request_id="s")
        engine.add_request("def main():", params, request_id="aborted")
        deltas: list[RequestOutput] = []
        for _ in range(3):
            deltas += engine.step()
        final = engine.abort_request("aborted")
        assert final is not None and final.outputs[0].finish_reason == "abort"
        assert engine.abort_request("aborted") is None
        while engine.has_unfinished_requests():
            deltas += engine.step()
        mine = [d for d in deltas if d.request_id == "s"]
        assert all(len(d.outputs[0].token_ids) == 1 for d in mine)
        assert "".join(d.outputs[0].text for d in mine) == full.text[:cut]
        assert mine[-1].finished and mine[-1].outputs[0].finish_reason == "stop"
        assert mine[-1].outputs[0].stop_reason == stop_str
        assert_all_free(engine)


def test_sampling_seeded_logprobs_chat_and_rejection(llama_dir: Path) -> None:
    with LLM(llama_dir, num_kv_blocks=64, max_model_len=128) as llm:
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=42, max_tokens=12,
                                logprobs=3)
        alone = llm.generate([[5, 6, 7]], seeded)[0].outputs[0]
        batched = llm.generate([{"prompt_token_ids": [9] * 30}, [5, 6, 7], "text"],
                               seeded, use_tqdm=True)[1].outputs[0]
        assert alone.token_ids == batched.token_ids  # the seed, not the batch, decides
        assert len(alone.logprobs) == len(alone.token_ids)
        for token_id, entry in zip(alone.token_ids, alone.logprobs, strict=True):
            assert token_id in entry and len(entry) in (3, 4)
        assert alone.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(alone.token_ids, alone.logprobs, strict=True)))
        chat = llm.chat([{"role": "user", "content": "hello"}],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        template = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
        assert chat.prompt_token_ids == llm.tokenizer.encode(template, add_special_tokens=False)
        assert len(chat.outputs[0].token_ids) == 4
        with pytest.raises(RequestRejectedError, match="max_model_len"):
            llm.generate([[1] * 128], GREEDY)
        with pytest.raises(ValueError, match="vocabulary|token ids"):
            llm.generate([[10**6]], GREEDY)
        assert_all_free(llm.engine)


def test_prefill_handoff_then_decode_equals_colocated(llama_dir: Path) -> None:
    """Prefill role hands off after one token; a decode-role engine given the KV blocks and
    the sampling position continues exactly as the colocated engine (greedy and seeded)."""
    prompt = list(range(3, 45))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    model_config = ModelConfig(model=str(llama_dir))
    cache_config = CacheConfig(num_blocks=64)
    prefill, saver = prefill_engine(model_config, cache_config, tokenizer=tokenizer)
    decode = Engine(model_config, cache_config, tokenizer=tokenizer, role=DecodeRole())
    try:
        with LLM(llama_dir, num_kv_blocks=64) as colocated:
            # ignore_eos: the hand-off needs a first token that does not end the request
            # (seed 7's first draw is eos)
            for params in (GREEDY, SamplingParams(temperature=1.0, seed=7, max_tokens=20,
                                                  stop=["never appears"], ignore_eos=True)):
                expected_out = colocated.generate([prompt], params)[0].outputs[0]
                expected = expected_out.token_ids
                prefill.add_request(prompt, params, request_id="r")
                (first,) = prefill.step()
                assert first.outputs[0].finish_reason == "handoff" and first.finished
                handoff = first.kv_handoff
                assert handoff is not None and len(handoff.block_keys) == len(prompt) // 16
                assert handoff.num_output_tokens == 1
                block_ids = decode.add_prefilled_request(
                    "r", prompt, params, [handoff.first_token_id])
                decode.runner.write_kv_blocks(block_ids, saver.blocks.pop("r"))
                tokens, text = [handoff.first_token_id], first.outputs[0].text
                while decode.has_unfinished_requests():
                    for out in decode.step():
                        tokens += out.outputs[0].token_ids
                        text += out.outputs[0].text
                assert tokens == expected
                assert text == expected_out.text  # the two streams join seamlessly
                assert_all_free(prefill)
                assert_all_free(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()
