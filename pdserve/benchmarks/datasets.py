"""Workloads: the prompts a benchmark sends, with their lengths and (for traces) send times.

Sources, each deterministic for a seed (vLLM's `random` and `prefix_repetition`, drawn as vLLM
draws them, live in vllm_datasets.py):
- shared-prefix: N random prefixes x M random suffixes, shuffled, so a prefix cache can hit;
- mooncake: a Mooncake-format JSONL trace (timestamp ms, input/output lengths, hash ids of
  512-token prefix blocks) scaled to fit a small machine. Each block's tokens are synthesized
  from its hash id alone, so requests that share leading ids share an identical token (and
  text) prefix, and requests with different ids do not.

Text is what crosses the wire (both OpenAI endpoints take it); `TokenCodec` turns ids into text
with the server's tokenizer, or, when none is given, into synthetic words (about one token
each; lengths are then nominal and the server's reported usage is the truth).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_WORD = re.compile(r" [A-Za-z]{2,}")


class DatasetError(ValueError):
    """A workload cannot be built from the given flags or file."""


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload."""

    prompt: str
    # Prompt length in tokens as the harness's tokenizer counts it (nominal without one).
    prompt_len: int
    # max_tokens sent; with --ignore-eos the server generates exactly this many.
    expected_output_len: int
    # Send time from the trace (seconds after start); None = the arrival process decides.
    arrival_offset_s: float | None = None


def _synthetic_words(num_words: int = 1024) -> list[str]:
    # Consonant-vowel syllable pairs: plain ASCII words that most BPE vocabularies split
    # into one or two tokens; only used when no tokenizer is given.
    consonants, vowels = "bcdfghjklmnprstvz", "aeiou"
    syllables = [c + v for c in consonants for v in vowels]
    # 85 x 85 distinct two-syllable words: no two ids share a word.
    return [" " + syllables[(i // len(syllables)) % len(syllables)] + syllables[i % len(syllables)]
            for i in range(num_words)]


class RustTokenizer:
    """The slice of a Hugging Face tokenizer's API this module uses, over `tokenizers` alone.

    A checkpoint's tokenizer.json holds the whole pipeline (normalizer, pre-tokenizer, model,
    decoder), so the Rust library encodes and decodes exactly as PreTrainedTokenizerFast does,
    without importing transformers (and with it torch) into a process that only measures HTTP.
    """

    # The special-token names Hugging Face's tokenizers hold as attributes (all_special_ids).
    _NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        self._tokenizer = Tokenizer.from_file(str(path))
        config = self._read_config(path.parent / "tokenizer_config.json")
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces",
                                                            False))
        # As Hugging Face counts them: the named special tokens and the extra ones, not every
        # added token flagged special (<|im_start|> is an added token but not "special" there).
        names = [config.get(key) for key in self._NAMED_SPECIAL]
        names += list(config.get("extra_special_tokens") or [])
        names += list(config.get("additional_special_tokens") or [])
        names += [v for k, v in self._read_config(path.parent / "special_tokens_map.json").items()
                  if k in self._NAMED_SPECIAL]
        ids = {self._tokenizer.token_to_id(self._token_text(n)) for n in names if n}
        self.all_special_ids = sorted(i for i in ids if i is not None)

    @staticmethod
    def _read_config(path: Path) -> dict[str, Any]:
        try:
            with open(path) as f:
                config = json.load(f)
        except FileNotFoundError:
            return {}
        return config if isinstance(config, dict) else {}

    @staticmethod
    def _token_text(token: Any) -> str:
        return token.get("content", "") if isinstance(token, dict) else str(token)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary without added tokens (Hugging Face's `vocab_size`)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return self._tokenizer.num_special_tokens_to_add(pair)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict[str, list]:
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}

    def decode(self, token_ids: Sequence[int]) -> str:
        text = self._tokenizer.decode(list(token_ids), skip_special_tokens=False)
        return _clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

    def batch_decode(self, sequences: Sequence[Sequence[int]]) -> list[str]:
        texts = self._tokenizer.decode_batch([list(s) for s in sequences],
                                             skip_special_tokens=False)
        return [_clean_up_spaces(t) for t in texts] if self.clean_up_tokenization_spaces \
            else texts


def _clean_up_spaces(text: str) -> str:
    """Hugging Face's `clean_up_tokenization` (used when a tokenizer's config asks for it)."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                           (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                           (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


def _word_token_ids(tokenizer: Any, min_words: int = 32) -> np.ndarray | None:
    """Ids of whole-word tokens (" word") whose any sequence re-tokenizes to itself, or None.

    Random token ids decode to text that re-tokenizes into a different number of tokens
    (BPE merges across ids). Tokens that are one space plus ASCII letters do not: GPT-style
    pre-tokenizers split before every space, so " foo bar" always encodes back to its ids.
    The property is checked on a sample, since tokenizers (SentencePiece) differ.
    """
    num_ids = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(num_ids)])
    candidates = [i for i, text in enumerate(texts) if _WORD.fullmatch(text)]
    if len(candidates) < min_words:
        return None
    encoded = tokenizer([texts[i] for i in candidates], add_special_tokens=False)["input_ids"]
    words = np.array([i for i, ids in zip(candidates, encoded, strict=True) if ids == [i]])
    if words.size < min_words:
        return None
    sample = [int(i) for i in np.random.default_rng(0).choice(words, 256)]
    if tokenizer.encode(tokenizer.decode(sample), add_special_tokens=False) != sample:
        return None
    return words


class TokenCodec:
    """Token ids <-> text, with a Hugging Face tokenizer or a synthetic word vocabulary."""

    def __init__(self, tokenizer: Any | None = None) -> None:
        self.tokenizer = tokenizer
        self.is_exact = False
        if tokenizer is None:
            self._words = _synthetic_words()
            self.vocab_ids = np.arange(len(self._words))
        else:
            self.vocab_ids = _word_token_ids(tokenizer)
            # Exact round trips: every prompt is exactly as long as asked and every trace
            # block is exactly block_size server tokens, so block boundaries line up.
            self.is_exact = self.vocab_ids is not None
            if self.vocab_ids is None:
                special = set(getattr(tokenizer, "all_special_ids", []) or [])
                self.vocab_ids = np.array([i for i in range(len(tokenizer)) if i not in special])
        if self.vocab_ids.size == 0:
            raise DatasetError("the tokenizer has no non-special tokens")

    @classmethod
    def load(cls, name_or_path: str | None, trust_remote_code: bool = False) -> TokenCodec:
        """A local dir with tokenizer.json loads with `tokenizers` alone; anything else with
        AutoTokenizer (imported only then: transformers pulls in torch). None: word fallback.
        """
        if name_or_path is None:
            return cls(None)
        if (Path(name_or_path) / "tokenizer.json").is_file():
            try:
                return cls(RustTokenizer(Path(name_or_path) / "tokenizer.json"))
            except Exception as e:  # noqa: BLE001 - a broken file is a user-facing flag error
                raise DatasetError(f"cannot load tokenizer {name_or_path!r}: {e}") from e
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover - transformers is a dependency
            raise DatasetError(f"--tokenizer needs transformers: {e}") from e
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                name_or_path, trust_remote_code=trust_remote_code
            )
        except Exception as e:  # noqa: BLE001 - any load failure is a user-facing flag error
            raise DatasetError(f"cannot load tokenizer {name_or_path!r}: {e}") from e
        return cls(tokenizer)

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    @property
    def vocab_size(self) -> int:
        """Base vocabulary size (Hugging Face's `vocab_size`; the word list without one)."""
        return len(self._words) if self.tokenizer is None else int(self.tokenizer.vocab_size)

    @property
    def num_special_tokens_to_add(self) -> int:
        """Tokens the tokenizer adds around a prompt (a BOS, ...)."""
        return 0 if self.tokenizer is None else int(self.tokenizer.num_special_tokens_to_add())

    @property
    def allowed_ids(self) -> np.ndarray:
        """[num_allowed] ids below vocab_size that are not special, ascending (vLLM's choice)."""
        special = set(getattr(self.tokenizer, "all_special_ids", None) or [])
        return np.array([i for i in range(self.vocab_size) if i not in special], dtype=np.int64)

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return "".join(self._words[int(i)] for i in token_ids)
        return self.tokenizer.decode(list(map(int, token_ids)))

    def count(self, text: str) -> int | None:
        """Tokens in `text`, or None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def sample_ids(self, rng: np.random.Generator, num_tokens: int) -> np.ndarray:
        """[num_tokens] token ids drawn uniformly from the non-special vocabulary."""
        return self.vocab_ids[rng.integers(0, self.vocab_ids.size, size=num_tokens)]

    def text_of_length(self, rng: np.random.Generator, num_tokens: int) -> tuple[str, int]:
        """Random text that re-tokenizes to (about) `num_tokens` tokens; returns (text, len).

        Decoding random ids and encoding again merges or splits tokens, so trim and top up a
        few times until the count matches (vLLM's random dataset does the same dance).
        """
        ids = self.sample_ids(rng, num_tokens)
        text = self.decode(ids)
        if self.tokenizer is None:
            return text, num_tokens
        for _ in range(4):
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == num_tokens:
                break
            if len(encoded) > num_tokens:
                ids = encoded[:num_tokens]
            else:
                ids = list(encoded) + list(self.sample_ids(rng, num_tokens - len(encoded)))
            text = self.decode(ids)
        return text, len(self.tokenizer.encode(text, add_special_tokens=False))


def shared_prefix_requests(codec: TokenCodec, num_prefixes: int, num_suffixes: int,
                           prefix_len: int, suffix_len: int, output_len: int,
                           seed: int = 0) -> list[BenchRequest]:
    """num_prefixes x num_suffixes prompts: every prefix with its own random suffixes, shuffled.

    The shuffle interleaves groups, so a prefix is reused across other traffic, not only
    back-to-back (which any cache would hit).
    """
    if min(num_prefixes, num_suffixes, prefix_len, suffix_len, output_len) < 1:
        raise DatasetError("shared-prefix dataset needs every count and length >= 1")
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_prefixes):
        prefix_text, prefix_tokens = codec.text_of_length(rng, prefix_len)
        for _ in range(num_suffixes):
            suffix_text, suffix_tokens = codec.text_of_length(rng, suffix_len)
            prompt = prefix_text + suffix_text
            # Only an inexact tokenizer can merge tokens across the join: count again then.
            prompt_len = prefix_tokens + suffix_tokens if codec.is_exact or \
                not codec.has_tokenizer else codec.count(prompt)
            requests.append(BenchRequest(prompt, prompt_len, output_len))
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


@dataclass(frozen=True)
class TraceScaling:
    """How a Mooncake trace shrinks to fit the machine."""

    # Multiplies timestamps: 0.1 replays ten times faster.
    time_scale: float = 1.0
    # Multiplies input and output lengths; the block size scales with it.
    length_scale: float = 1.0
    # Tokens per hash-id block in the trace file (Mooncake's traces: 512).
    trace_block_size: int = 512

    def __post_init__(self) -> None:
        if not (self.time_scale > 0 and self.length_scale > 0):
            raise DatasetError("--time-scale and --length-scale must be > 0")
        if self.trace_block_size < 1:
            raise DatasetError("--trace-block-size must be >= 1")

    @property
    def block_size(self) -> int:
        """Tokens per block after scaling (e.g. 512 -> 16 at length_scale 1/32)."""
        return max(1, round(self.trace_block_size * self.length_scale))


def block_token_ids(codec: TokenCodec, hash_id: int, block_size: int, seed: int = 0) -> np.ndarray:
    """[block_size] token ids determined by (hash_id, seed) alone, never by position."""
    rng = np.random.default_rng([seed, int(hash_id)])
    return codec.sample_ids(rng, block_size)


def load_mooncake_trace(path: str | Path, num_requests: int | None = None) -> list[dict]:
    """Parsed trace lines (first `num_requests` if given), each checked for the fields used."""
    entries: list[dict] = []
    try:
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
                if num_requests is not None and len(entries) >= num_requests:
                    break
                if not line.strip():
                    continue
                entry = json.loads(line)
                for field in ("timestamp", "input_length", "output_length", "hash_ids"):
                    if field not in entry:
                        raise DatasetError(f"{path}:{line_no}: missing field {field!r}")
                entries.append(entry)
    except OSError as e:
        raise DatasetError(f"cannot read trace {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: not JSONL: {e}") from e
    if not entries:
        raise DatasetError(f"trace {path} has no requests")
    return entries


def mooncake_requests(codec: TokenCodec, entries: Sequence[dict], scaling: TraceScaling,
                      seed: int = 0) -> list[BenchRequest]:
    """Scaled trace requests; send times come from the trace's timestamps."""
    from pdserve.benchmarks.arrivals import trace_offsets_s

    block_size = scaling.block_size
    offsets_s = trace_offsets_s([e["timestamp"] for e in entries], scaling.time_scale)
    block_texts: dict[int, str] = {}  # hash id -> its block's text, shared by every user
    requests = []
    for entry, offset_s in zip(entries, offsets_s, strict=True):
        hash_ids = [int(h) for h in entry["hash_ids"]]
        if not hash_ids:
            raise DatasetError("trace entry without hash_ids")
        # Scaled length, kept inside its last block: ceil(len / block) == number of ids.
        scaled_len = round(int(entry["input_length"]) * block_size / scaling.trace_block_size)
        input_len = min(len(hash_ids) * block_size,
                        max((len(hash_ids) - 1) * block_size + 1, scaled_len))
        pieces = []
        for i, hash_id in enumerate(hash_ids):
            if hash_id not in block_texts:
                block_texts[hash_id] = codec.decode(
                    block_token_ids(codec, hash_id, block_size, seed))
            if i < len(hash_ids) - 1:
                pieces.append(block_texts[hash_id])
        # The last block is partial; its tokens are the leading part of its id's block.
        tail = input_len - (len(hash_ids) - 1) * block_size
        pieces.append(codec.decode(block_token_ids(codec, hash_ids[-1], block_size, seed)[:tail]))
        output_len = max(1, round(int(entry["output_length"]) * scaling.length_scale))
        prompt = "".join(pieces)
        if codec.has_tokenizer and not codec.is_exact:
            input_len = codec.count(prompt)  # blocks re-tokenize to other lengths: measure
        requests.append(BenchRequest(prompt, input_len, output_len, float(offset_s)))
    return requests
