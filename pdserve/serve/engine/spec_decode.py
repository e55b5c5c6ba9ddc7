"""Speculative decoding with DeepSeek-V3's multi-token-prediction (MTP) module (vLLM's
`speculative_config={"method": "mtp", "num_speculative_tokens": k}`).

The checkpoint's MTP module (model.layers.{num_hidden_layers}.*: enorm, hnorm, eh_proj, one
decoder block, shared_head.norm/head; the embedding is the main model's) drafts; the main
model verifies every draft of a sequence in one forward (the executor builds and loads the MTP
layer: pdserve/serve/executor/loader.py load_mtp_weights). One engine step, per running
sequence with drafts d1..dk (its last sampled token t at position n):

    verify   main forward over [t d1 .. dk] at positions n .. n+k   (1 + k query rows, KV
             written for all of them) -> logits rows p_0 .. p_k
    accept   greedy: keep d_j while d_j == argmax p_(j-1); then the argmax of the first row
             that disagreed (or of p_k when all agreed: the bonus token)
             sampled: keep d_j with probability min(1, p(d_j) / q(d_j)); on the first
             rejection draw from norm(max(0, p - q)); a bonus draw from p_k when all agreed
             (MTP drafts greedily, so q is one-hot and the rule reads: keep d_j with
             probability p(d_j), else draw from p with d_j removed)
    roll back  the sequence's length becomes n + 1 + accepted; blocks past it are freed
    draft    MTP forward over this step's kept positions, each row pairing the main model's
             final hidden state h_i with the token that follows position i:

                 row i:  eh_proj([enorm(embed(t_(i+1))) ; hnorm(h_i)]) -> block -> head
                         predicts t_(i+2); the MTP layer's KV at position i is written

             the last row gives draft 1; drafts 2..k chain the MTP on its own output
             (its hidden state and its argmax token, one position further), as vLLM does.

The MTP layer's KV lives in its own one-layer cache indexed by the main pool's block ids, so
it shares the block tables and is freed with them. Every position the main model computes,
prefill chunks included, goes through the MTP pass, so its KV is complete up to the last
computed position; positions written by a rejected draft or a chained draft are overwritten
before anything reads them (an MTP query at position p reads positions <= p, and the pass
that writes p comes first). A prefix-cache hit reuses the MTP rows of the cached blocks
(the last row of a block was computed with the token that followed it then: drafts may be
worse, tokens never change). Drafts only ever change how many tokens a step yields, never
which: the output is the main model's.

Decode role (after a hand-off): the hand-off carries the main layers' KV only, and the MTP
layer's KV at a prompt position needs the main model's hidden state there, which no worker
sends. A decode worker with MTP therefore prefills the MTP layer on the request's first
step by recomputing the prompt through the main model (the handed-off KV is rewritten with
the same values): correct, at the cost of one prompt forward on decode. Handing the MTP
layer's KV over as one more layer (the prefill worker running the MTP pass) would remove
that cost; it is not built.

A verify step's attention takes each of a sequence's 1 + k tokens as its own decode query
row (context up to and including itself: pdserve/serve/layers/attention.py token_seq_lens), so it
runs the MLA decode kernel, not the prefill path; so does the MTP pass over as few rows.

Limits: tensor_parallel_size 1; requests with logprobs, penalties, logit controls (bias,
allowed or bad words), a grammar or min_tokens still pending decode one token a step. The
children of an n > 1 request draft from an MTP cache the fork did not copy (it may lack their
prompt's last rows): fewer drafts kept, the same tokens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pdserve.serve.config import SpeculativeConfig
from pdserve.serve.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdserve.serve.engine.block_manager import BlockManager
    from pdserve.serve.engine.sampler import Sampler
    from pdserve.serve.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

# ---- accept / reject ---------------------------------------------------------------------


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[int],
                     draft_probs: torch.Tensor | None, generator: torch.Generator
                     ) -> list[int]:
    """The standard speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023).

    target_probs [k + 1, V]: the target's distribution at each verified position;
    draft_probs [k, V] the drafter's (None: one-hot at each draft, a greedy drafter).
    Returns the kept drafts and one more token (a correction or the bonus): 1..k+1 tokens,
    distributed exactly as k + 1 draws from the target would be, whatever q is."""
    k = len(draft_token_ids)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"{target_probs.shape[0]} target rows for {k} drafts")
    out: list[int] = []
    for j, draft in enumerate(draft_token_ids):
        p = target_probs[j]
        q = draft_probs[j] if draft_probs is not None else None
        q_draft = 1.0 if q is None else float(q[draft])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * q_draft < float(p[draft]):  # u < p/q: kept with probability min(1, p/q)
            out.append(draft)
            continue
        if q is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - q).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:  # only by rounding: p <= q everywhere means p == q
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return out


def greedy_verify(target_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """The rule above with one-hot p (greedy): keep drafts while they equal the target's
    argmax, then the target's own token at the first disagreement (or the bonus)."""
    out: list[int] = []
    for draft, target in zip(draft_token_ids, target_token_ids, strict=False):
        if draft != target:
            break
        out.append(draft)
    out.append(target_token_ids[len(out)])
    return out


# ---- metrics -----------------------------------------------------------------------------


@dataclass
class SpecDecodeStats:
    """Totals since start, as vLLM's spec-decode counters."""

    num_drafts: int = 0
    """Verify steps of a sequence that carried drafts."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """accepted_per_pos[j]: drafts at position j (0-based) that were accepted."""

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.append(0)
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        """The worker status' spec_decode field (pdserve/router/metrics.py reads these keys)."""
        totals = {"num_drafts": float(self.num_drafts),
                  "num_draft_tokens": float(self.num_draft_tokens),
                  "num_accepted_tokens": float(self.num_accepted_tokens)}
        for j, count in enumerate(self.accepted_per_pos):
            totals[f"accepted_pos_{j}"] = float(count)
        return totals


# ---- the engine's part -------------------------------------------------------------------


@dataclass
class DraftChunk:
    """One sequence's rows of an MTP pass (rank 0, in process: no wire message)."""

    request_id: str
    token_ids: list[int]
    """The token after each position (t_(i+1) for row i)."""
    start_pos: int
    block_table: list[int]
    hidden_start: int
    """Row of the step's main hidden states that belongs to start_pos."""
    num_drafts: int
    """Drafts to return (0: only write the MTP layer's KV)."""


def is_eligible(request: Request) -> bool:
    """Whether drafts can be verified for this request with the sampler's exact meaning."""
    params = request.sampling_params
    return (params.logprobs is None and not params.has_penalties
            and not params.has_logit_controls and request.grammar is None
            and request.num_output_tokens >= params.min_tokens)


class MTPSpeculator:
    """What the engine does around a step when MTP speculative decoding is on."""

    def __init__(self, config: SpeculativeConfig, runner: Any, block_manager: BlockManager,
                 max_model_len: int) -> None:
        self.config = config
        self.runner = runner
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()

    def verify(self, request: Request, logits: torch.Tensor, sampler: Sampler,
               generator: torch.Generator) -> list[int]:
        """logits [1 + k, V] of the verify rows -> the tokens to append (1..k+1)."""
        drafts = request.spec_token_ids[:logits.shape[0] - 1]  # the budget may cut some
        if request.sampling_params.is_greedy:
            tokens = greedy_verify(logits.argmax(dim=-1).tolist(), drafts)
        else:
            probs = sampler.sampling_probs(logits, [request] * logits.shape[0])
            tokens = rejection_sample(probs, drafts, None, generator)
        self.stats.observe(len(drafts), len(tokens) - 1)
        return tokens

    def generator_for(self, request: Request, engine_generator: torch.Generator
                      ) -> torch.Generator:
        """Seeded requests draw from a generator seeded by (seed, index of the first token
        this step yields): reproducible whatever the batch. Others share the engine's."""
        seed = request.sampling_params.seed
        if seed is None:
            return engine_generator
        from pdserve.serve.engine.sampler import seed_for_token

        return torch.Generator().manual_seed(seed_for_token(seed, request.num_output_tokens))

    def roll_back(self, request: Request, num_accepted: int) -> None:
        """After verify: the kept drafts' KV counts as computed; blocks past the computed
        length (the rejected drafts' slots) go back to the pool."""
        request.num_computed_tokens += num_accepted
        bm = self.block_manager
        bm.commit_computed(request)
        bm.free_tail(request, request.num_computed_tokens)

    def propose(self, scheduled: SchedulerOutput) -> None:
        """The MTP pass over this step's computed positions of every sequence still running;
        sets the next drafts of those that sampled this step."""
        bm = self.block_manager
        chunks: list[DraftChunk] = []
        requests: list[Request] = []
        hidden_start = 0
        for (request, num_new), chunk in zip(scheduled.scheduled, scheduled.step.chunks,
                                             strict=True):
            start = hidden_start
            hidden_start += num_new
            request.spec_token_ids = []
            if request.status is not RequestStatus.RUNNING or not bm.has_blocks(
                    request.request_id):
                continue  # finished (its blocks are gone) or forked into children
            num_rows = request.num_computed_tokens - chunk.start_pos
            if num_rows <= 0 or request.num_tokens < request.num_computed_tokens + 1:
                continue
            num_drafts = 0
            if chunk.need_logits and is_eligible(request):
                num_drafts = self._num_drafts(request)
            token_ids = request.all_token_ids[chunk.start_pos + 1:
                                              chunk.start_pos + 1 + num_rows]
            chunks.append(DraftChunk(request.request_id, token_ids, chunk.start_pos,
                                     list(bm.block_table(request.request_id)), start,
                                     num_drafts))
            requests.append(request)
        if not chunks:
            return
        drafts = self.runner.propose_drafts(chunks)
        for request, chunk, tokens in zip(requests, chunks, drafts, strict=True):
            request.spec_token_ids = list(tokens[:chunk.num_drafts])

    def _num_drafts(self, request: Request) -> int:
        """k, less what the request's max_tokens and max_model_len leave, and less what the
        pool cannot hold for the chained drafts' MTP rows (positions past the sequence)."""
        n = request.num_computed_tokens  # position of the token the drafts follow
        room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - n) - 1
        num_drafts = max(0, min(self.config.num_speculative_tokens, room))
        if num_drafts > 1:
            bm = self.block_manager
            if bm.can_append(request, num_drafts - 1):
                bm.append_slots(request, num_drafts - 1)  # chained drafts' MTP rows
            else:
                num_drafts = 1
        return num_drafts


# ---- tiny MTP checkpoints (tests and benchmarks) -----------------------------------------


def add_mtp_layer(model_dir: str | Path, mirror: bool, seed: int = 0) -> Path:
    """Append an MTP layer (DeepSeek's release names) to a DeepSeek-V3 checkpoint that
    pdserve/serve/default_model.build_random_model wrote, and set num_nextn_predict_layers = 1.

    mirror=True rewrites the model so the MTP module predicts exactly what the main model
    will: every attention output projection is zeroed (the main model becomes a function
    of the current token alone), layer 0's MLP is zeroed, the embedding rows get unit RMS,
    and the MTP block copies the last layer with eh_proj = [I | 0] (it reads the embedding
    of the token it is given), shared_head = the final norm and the LM head. Then draft i+2
    from (t_(i+1), h_i) is the main model's prediction at i+1: acceptance near 1.
    mirror=False draws the MTP layer at random: acceptance near 1 / vocab."""
    from safetensors.torch import load_file, save_file

    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    num_layers = int(config["num_hidden_layers"])
    hidden = int(config["hidden_size"])
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    last = f"model.layers.{num_layers - 1}."
    mtp = f"model.layers.{num_layers}."
    gen = torch.Generator().manual_seed(seed)
    if mirror:
        embed = tensors["model.embed_tokens.weight"]
        tensors["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
        for name in list(tensors):
            if name.endswith("self_attn.o_proj.weight"):
                tensors[name] = torch.zeros_like(tensors[name])
            if name.endswith("down_proj.weight") and not name.startswith(last):
                tensors[name] = torch.zeros_like(tensors[name])  # MLPs below the last: off
    for name in [n for n in tensors if n.startswith(last)]:
        source = tensors[name]
        if not mirror:
            source = (torch.randn(source.shape, generator=gen) * 0.2).to(source.dtype)
            if name.endswith("layernorm.weight"):
                source = torch.ones_like(source)
        tensors[mtp + name[len(last):]] = source.clone()
    dtype = tensors["model.embed_tokens.weight"].dtype
    if mirror:
        eh_proj = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
        head, norm = tensors["lm_head.weight"], tensors["model.norm.weight"]
    else:
        eh_proj = torch.randn(hidden, 2 * hidden, generator=gen) * hidden**-0.5
        head = torch.randn(tensors["lm_head.weight"].shape, generator=gen) * 0.2
        norm = torch.ones(hidden)
    tensors.update({
        mtp + "enorm.weight": torch.ones(hidden, dtype=dtype),
        mtp + "hnorm.weight": torch.ones(hidden, dtype=dtype),
        mtp + "eh_proj.weight": eh_proj.to(dtype),
        mtp + "shared_head.norm.weight": norm.to(dtype).clone(),
        mtp + "shared_head.head.weight": head.to(dtype).clone(),
        mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    })
    save_file(tensors, str(path), metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2))
    return model_dir
