"""White-box drafters: ``eagle:NAME`` (a shipped head) or ``eagle:PATH`` (a trained folder).

An EAGLE head (specpool/drafters/eagle_model.py) drafts from the target's own features, which
verification returns when the pool holds a white-box arm (specpool/target/features.py, and
``speculative_generate`` in specpool/router/loop.py). Per session the drafter keeps

- a ``FeatureLog``: the target's feature of every context position it has been told about;
- the head's KV cache over head positions 0 .. m-1 (position t read x_{t+1} and f_t), and the
  tokens those positions read, so a new round only computes the positions it has not seen and a
  changed context (another request of the session, a rollback) cuts the cache where it differs.

A round with context x_0 .. x_{n-1} needs f_0 .. f_{n-2} (the last token's feature comes with the
next verification): the head catches up on positions m .. n-2 in one forward, whose last output
guesses f_{n-1} and so the first draft token; each further draft step feeds the head its own
guess. Draft positions are cropped from the cache afterwards: they were computed from guessed
features, the next round has the target's. Each draft token's q is exactly the distribution it was
drawn from (one-hot when greedy, top-K at the request's temperature otherwise), mapped from the
reduced vocabulary to full ids, so verification stays lossless (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from specpool.core.errors import IncompatibleModels, InvalidArgument, ModelUnavailable
from specpool.drafters.base import CostMeter, DraftRequest, Proposal, leading_matches
from specpool.drafters.eagle_model import EagleConfig, EagleHead
from specpool.drafters.hf_model import LEAF_STREAM, confidence_stop, proposal_dist, sample_draft
from specpool.drafters.registry import DrafterContext, register_drafter, register_name_resolver
from specpool.drafters.weight_storage import unpack
from specpool.drafters.zoo_model import KVCache
from specpool.target.features import Features, FeatureLog
from specpool.target.kv_cache import common_prefix_length
from specpool.target.models import resolve_model
from specpool.target.rejection import SparseDist
from specpool.target.sampling import SamplingParams, request_generator
from specpool.target.tree import ROOT
from specpool.target.verifier import plan_forwards

SHIPPED_DIR = Path(__file__).parent / "heads"
MANIFEST = SHIPPED_DIR / "manifest.json"  # file hashes and reference acceptance (specpool zoo manifest)
HEAD_KIND = "eagle"
TREE_KIND = "eagle-tree"  # the same heads drafting trees (``EagleDrafter.propose_tree``)
ALT_KIND = "eagle-alt"  # the same heads' chain plus runner-up leaves (``EagleDrafter.alternatives``)
INT8_KIND = "eagle-int8"  # the same heads drafting with int8 kernels on a CPU (``EagleHead.set_draft_precision``)
ALT_INT8_KIND = "eagle-alt-int8"  # ``eagle-alt``'s leaves drafted with ``eagle-int8``'s kernels (the default drafter)
# ``eagle-alt``: at the first DEFAULT_ALTERNATIVES depths of the chain, the head's next
# DEFAULT_ALT_PER_DEPTH choices after its first are leaves where it gives them at least
# DEFAULT_ALT_MIN_PROB. A CPU forward is padded to a few widths (TargetVerifier), so most leaves
# fill positions the chain's forward computes anyway. Swept side by side on the dev and our own
# held-out prompts (bench/results/white-box-leaves/): 3 depths x 3 leaves at 0.05 drafted 2.01 and
# 1.72 tokens per round against the chain's 1.77 and 1.57, and 1 leaf at 2 depths at 0.15 (the
# setting before) 1.87 and 1.61.
DEFAULT_ALTERNATIVES = 3
DEFAULT_ALT_MIN_PROB = 0.05
DEFAULT_ALT_PER_DEPTH = 3
DEFAULT_TREE_NODES = 16
DEFAULT_TREE_BEAM = 4
DEFAULT_TREE_MIN_PROB = 0.0
# ``propose_batch``: sessions catching up on similar numbers of positions share a padded head
# forward; a pad costs a position's compute, another forward a pass over the head's weights, which
# on a CPU takes about as long as a few positions' compute (``plan_forwards``).
HEAD_SPLIT_COST_TOKENS = 8


def shipped_heads() -> list[str]:
    """Head folders shipped in specpool/drafters/heads/."""
    if not SHIPPED_DIR.is_dir():
        return []
    return sorted(p.name for p in SHIPPED_DIR.iterdir() if (p / "config.json").exists())


def head_folder(argument: str) -> Path:
    """A shipped head's name (``general``) -> its folder; anything else is a path."""
    return SHIPPED_DIR / argument if argument in shipped_heads() else Path(argument).expanduser()


def target_card(target_dir: Path) -> dict:
    """What a head must match in its target: feature width and depth (from its config.json)."""
    config = json.loads((target_dir / "config.json").read_text())
    return {"hidden_size": int(config["hidden_size"]), "num_hidden_layers": int(config["num_hidden_layers"])}


def check_card(metadata: dict, target_name: str, card: dict, where: Path) -> None:
    """One line when the head was trained for another target than the one it would serve."""
    trained = metadata.get("target_card", {})
    for key, label in (("hidden_size", "width"), ("num_hidden_layers", "layers")):
        if trained.get(key) != card[key]:
            raise IncompatibleModels(
                f"white-box head {where} was trained for {metadata.get('target')} ({label} {trained.get(key)}), "
                f"but the target {target_name} has {label} {card[key]}: train a head for this target "
                f"(specpool zoo train --arch eagle)")


def load_eagle_head(folder: Path, home: Path, target: str, device: str = "cpu") -> tuple[EagleHead, dict]:
    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    if not folder.exists():
        raise ModelUnavailable(f"no white-box head {str(folder)!r}: neither a shipped head "
                               f"(shipped: {', '.join(shipped_heads()) or 'none'}) nor a folder")
    if not config_path.exists() or not weights_path.exists():
        raise ModelUnavailable(f"{folder} is not a white-box head (needs config.json and model.safetensors)")
    metadata = json.loads(config_path.read_text())
    if metadata.get("kind") != HEAD_KIND:
        raise InvalidArgument(f"{folder} holds a {metadata.get('kind')!r} drafter, not a white-box head; "
                              f"load it as {metadata.get('kind')}:{folder}")
    target_dir = Path(resolve_model(target, home))
    if not (target_dir / "config.json").exists() or not (target_dir / "model.safetensors").exists():
        raise ModelUnavailable(f"white-box head {folder} needs its target {target} as a local folder with config.json "
                               "and model.safetensors (it borrows the target's embedding and output head)")
    check_card(metadata, target, target_card(target_dir), folder)
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as handle:
        embedding = handle.get_tensor("model.embed_tokens.weight").float()  # (V, d), frozen, shared
        output = handle.get_tensor("lm_head.weight").float() if "lm_head.weight" in handle.keys() else None
    try:
        weights = unpack(load_file(str(weights_path)))  # float16 or int8 storage (weight_storage.py)
    except Exception as exc:  # noqa: BLE001 - any unreadable file means the same to the user
        raise ModelUnavailable(f"{weights_path} is unreadable ({exc})") from exc
    config = EagleConfig(**metadata["model"])
    if config.feature_layers:  # bench/feature_fusion.py trains such heads; verification returns the final feature only
        raise InvalidArgument(f"{folder} reads target layers {list(config.feature_layers)} beside the final feature; "
                              "the target's verification returns the final feature only, so it cannot draft")
    head = EagleHead(config, embedding, weights["vocab_ids"].long(), output)
    head.load_state_dict(weights)
    head.to(device).eval()
    return head, metadata


@dataclass
class HeadSession:
    """One session's state in one head (module docstring)."""

    features: FeatureLog
    cache: KVCache
    tokens: list[int] = field(default_factory=list)  # x_{t+1} read by head positions 0 .. m-1

    def crop(self, length: int) -> None:
        """Keep head positions 0 .. length-1. The cache's own length counts, not ``tokens``': draft
        steps grow the cache past the positions ``tokens`` records (they read guessed features)."""
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)
        del self.tokens[length:]


class EagleDrafter:
    """``specpool.drafters.base`` Drafter, Replayable and WhiteBox over an ``EagleHead``."""

    def __init__(self, name: str, head: EagleHead, metadata: dict, top_k: int = 16,
                 confidence_threshold: float = 0.3, cache_capacity: int = 64, tree_nodes: int = 0,
                 tree_beam: int = DEFAULT_TREE_BEAM, tree_min_prob: float = DEFAULT_TREE_MIN_PROB,
                 alternatives: int = 0, alt_min_prob: float = DEFAULT_ALT_MIN_PROB,
                 alt_per_depth: int = DEFAULT_ALT_PER_DEPTH):
        if top_k < 1:
            raise InvalidArgument(f"drafter top-k must be >= 1, got {top_k}")
        self.name = name
        self.head = head
        self.metadata = metadata
        self.tokenizer_fingerprint = metadata["target_tokenizer_fingerprint"]
        self.feature_width = head.config.hidden_size
        self.top_k = top_k
        # Stop drafting where the head doubts its own token (as the zoo drafters do): on a CPU
        # every verified position costs. The stop depends only on the head's state: exact.
        self.confidence_threshold = confidence_threshold
        self.cache_capacity = cache_capacity
        if tree_nodes < 0 or tree_beam < 1 or not 0.0 <= tree_min_prob < 1.0:
            raise InvalidArgument(f"a draft tree needs nodes >= 0, beam >= 1 and a minimum path probability in [0, 1); "
                                  f"got {tree_nodes}, {tree_beam}, {tree_min_prob}")
        # Draft trees (``propose_tree``, ``eagle-tree:NAME``): at most this many nodes, each level
        # expanding the best ``tree_beam`` nodes; 0: chains only.
        self.tree_nodes = tree_nodes
        self.tree_beam = tree_beam
        self.tree_min_prob = tree_min_prob
        if alternatives < 0 or alt_per_depth < 1 or not 0.0 <= alt_min_prob < 1.0:
            raise InvalidArgument(f"runner-up leaves need a count >= 0, at least one a depth and a minimum probability "
                                  f"in [0, 1); got {alternatives}, {alt_per_depth}, {alt_min_prob}")
        # Runner-up leaves (``eagle-alt:NAME``): the tree is the chain ``propose`` drafts plus, at
        # its first ``alternatives`` depths, the head's next ``alt_per_depth`` choices as leaves
        # beside the chain's token. A leaf costs no head step (its logits are the chain's) and one
        # verified position; where the head's first choice misses, the runners-up are the likeliest
        # tokens to be right.
        # EAGLE-2's tree (``tree_nodes``) costs a batched head step per level and up to 16 positions,
        # too many for a CPU (bench/results/white-box-trees); this is the tree a CPU can afford.
        self.alternatives = alternatives
        self.alt_min_prob = alt_min_prob
        self.alt_per_depth = alt_per_depth
        if alternatives > 0:
            self.tree_nodes = tree_nodes or 1  # the loop asks ``propose_tree`` of a drafter with nodes
        self.cost = CostMeter()
        self.output_ids = head.vocab_ids.cpu()  # reduced index -> full token id
        self._sessions: OrderedDict[str, HeadSession] = OrderedDict()

    @property
    def sampled_trees(self) -> bool:
        """Sampled rounds get trees from leaves only (``_leaf_tokens``): an EAGLE-2 tree's children
        are the head's likeliest tokens, not draws, which the sampled walk cannot verify exactly."""
        return self.alternatives > 0

    @property
    def model(self) -> EagleHead:
        """The network it drafts with, by the name zoo drafters give theirs: what the online
        learner trains (specpool/learning/hot_swap.py, ``specpool learner``'s base models)."""
        return self.head

    def _session(self, session_id: str) -> HeadSession:
        session = self._sessions.pop(session_id, None)
        if session is None:
            session = HeadSession(FeatureLog(self.feature_width, device=self.head.device), self.head.new_cache())
        self._sessions[session_id] = session
        while len(self._sessions) > self.cache_capacity:
            self._sessions.popitem(last=False)
        return session

    def observe_features(self, session_id: str, features: Features) -> None:
        session = self._session(session_id)
        session.features.apply(features)  # a gap raises FeatureGap: the sender resends
        session.crop(features.start)  # positions from start on read features that may have changed

    def features_held(self, session_id: str) -> int:
        """How many positions' features the session holds (0 for an unknown session)."""
        session = self._sessions.get(session_id)
        return len(session.features) if session is not None else 0

    def _catch_up(self, session_id: str, context_ids: list[int]) -> tuple[HeadSession, torch.Tensor] | None:
        """Feed the head the context positions it has not seen; returns the session and the head's
        guess of f_{n-1} (d,), the source of the first draft token; None without features."""
        unseen = self._unseen(session_id, context_ids)
        if unseen is None:
            return None
        session, inputs, feats = unseen
        guess = self.head(inputs.unsqueeze(0), feats.unsqueeze(0), session.cache)[0, -1]  # (d,): the head's f^_{n-1}
        session.tokens.extend(inputs.tolist())
        return session, guess

    def _unseen(self, session_id: str, context_ids: list[int]) -> tuple[HeadSession, torch.Tensor, torch.Tensor] | None:
        """The session, cropped to the head positions that stay, and what the head must still read:
        the tokens (T,) and the target's features (T, d) of positions m .. n-2; None without
        features. The caller feeds them and then records them in ``tokens``."""
        n = len(context_ids)
        session = self._sessions.get(session_id)  # not created here: a session without features would evict one with
        if session is None or n < 2 or len(session.features) < n - 1:
            return None  # no features for this context yet (the loop's prefill round gives them)
        self._sessions.move_to_end(session_id)  # least recently used goes first
        # Positions 0 .. m-1 stay if they read these very tokens; at least one position is fed
        # again, so the head's output at position n-2 (the first draft's source) is at hand.
        m = min(common_prefix_length(session.tokens, context_ids[1:n]), n - 2)
        session.crop(m)
        inputs = torch.tensor(context_ids[m + 1:n], dtype=torch.long, device=self.head.device)  # (n-1-m,)
        feats = session.features.rows(m, n - 1)  # (n-1-m, d): f_m .. f_{n-2}
        return session, inputs, feats

    @torch.inference_mode()
    def _draft(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams,
               runners_up: list[list[int]] | None = None) -> Proposal:
        """The chain. ``runners_up``, if given, gets the leaves of each of the first ``alternatives``
        depths (``leaf_tokens``)."""
        n = len(context_ids)
        started = time.perf_counter()
        caught_up = self._catch_up(session_id, context_ids) if k > 0 else None
        if caught_up is None:
            return Proposal([], [])
        session, guess = caught_up
        tokens: list[int] = []
        q: list[SparseDist] = []
        for i in range(k):
            logits = self.head.reduced_logits(guess)  # (V_r,)
            token, dist, more = self._draw(logits, params, n, i, k)
            tokens.append(token)
            q.append(dist)
            if runners_up is not None and i < self.alternatives:
                runners_up.append(self._leaf_tokens(logits, token, dist, params, n + i))
            if not more:
                break
            step = torch.tensor([[tokens[-1]]], dtype=torch.long, device=self.head.device)  # (1, 1)
            guess = self.head(step, guess.view(1, 1, -1), session.cache)[0, -1]  # position n-1+i
        session.crop(n - 1)  # draft positions read guessed features; the next round has the target's
        return Proposal(tokens, q, time.perf_counter() - started)

    def _leaf_tokens(self, logits: torch.Tensor, token: int, dist: SparseDist, params: SamplingParams,
                     position: int) -> list[int]:
        """The leaves beside the chain's ``token`` at one depth, from the head's logits (V_r,) there.

        Greedy: the head's next ``alt_per_depth`` choices after its first that it gives at least
        ``alt_min_prob``, best first. Sampled: as many as q (``dist``, which ``token`` was drawn
        from) has other tokens of at least ``alt_min_prob`` (at most ``alt_per_depth``), drawn from q
        one after another without replacement, on a random stream of their own; the count depends on
        q and the chain's token only, never on a leaf's draw, so each leaf is a draw from q without
        the tokens before it, as the target's recursive rejection sampling needs
        (``specpool.target.rejection.speculative_verify_tree``)."""
        if params.greedy:
            probs, ids = torch.softmax(logits.float(), dim=-1).topk(min(1 + self.alt_per_depth, logits.shape[-1]))  # best first
            return [int(self.output_ids[int(j)]) for p, j in zip(probs[1:], ids[1:]) if float(p) >= self.alt_min_prob]
        left = dist.probs.clone().float()
        left[dist.token_ids == token] = 0.0
        count = min(self.alt_per_depth, int((left >= max(self.alt_min_prob, 1e-12)).sum()))
        generator = request_generator(params.seed, position, LEAF_STREAM)
        leaves = []
        for _ in range(count):
            j = int(torch.multinomial(left, 1, generator=generator))
            leaves.append(int(dist.token_ids[j]))
            left[j] = 0.0
        return leaves

    def _draw(self, logits: torch.Tensor, params: SamplingParams, n: int, i: int, k: int) -> tuple[int, SparseDist, bool]:
        """Draft token i of a chain after a context of n tokens, from the head's logits (V_r,): the
        token, its q, and whether the chain goes on (not at k, not stopped by the head's doubt).
        ``_draft`` and ``propose_batch`` draw and stop by this one rule."""
        dist = proposal_dist(logits, params, self.top_k, self.output_ids)
        more = i + 1 < k and not confidence_stop(logits, i, k, self.confidence_threshold)
        return sample_draft(dist, params, n + i), dist, more

    @torch.inference_mode()
    def propose_tree(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams) -> Proposal:
        """``specpool.drafters.base.TreeDrafter``: with ``alternatives``, the chain and its runner-up
        leaves (``_draft_alternatives``; greedy or sampled); otherwise EAGLE-2's dynamic draft tree,
        greedy:

        Each level expands the ``tree_beam`` best nodes of the level before (by path probability,
        the product of the head's probabilities along the path) into their ``tree_beam`` likeliest
        children, in one batched head step: every row's cache is the context's plus its own path.
        Of all nodes expanded, the ``tree_nodes`` likeliest whose path probability is at least
        ``tree_min_prob`` form the tree (a path's probability never exceeds its parent's, so the
        choice keeps every node's ancestors). q of a node is one-hot on its token: in a greedy
        round it was chosen, not drawn."""
        started = time.perf_counter()
        proposal = self._draft_tree(session_id, context_ids, k, params)
        self.cost.record(time.perf_counter() - started, len(proposal.tokens))
        return proposal

    def _draft_tree(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams) -> Proposal:
        if self.alternatives > 0:
            return self._draft_alternatives(session_id, context_ids, k, params)
        if not params.greedy:
            raise InvalidArgument("an EAGLE-2 draft tree is for greedy decoding; sampled rounds draft chains (propose) "
                                  "or runner-up leaves (eagle-alt)")
        started = time.perf_counter()
        caught_up = self._catch_up(session_id, context_ids) if k > 0 and self.tree_nodes > 0 else None
        if caught_up is None:
            return Proposal([], [], parents=())
        session, guess = caught_up
        n, beam = len(context_ids), self.tree_beam
        # Candidates: (log path probability, parent candidate or ROOT, token); a row of ``frontier``
        # is a candidate whose children the next level computes, with the head's guess before it.
        scores: list[float] = []
        parent_of: list[int] = []
        token_of: list[int] = []
        frontier, guesses = [ROOT], guess.view(1, -1)  # frontier node j's guess and cache are row j
        cache = session.cache
        floor = math.log(self.tree_min_prob) if self.tree_min_prob > 0 else -math.inf
        for depth in range(k):
            logp = torch.log_softmax(self.head.reduced_logits(guesses).float(), dim=-1)  # (F, V_r)
            top_logp, top_ids = logp.topk(min(beam, logp.shape[-1]), dim=-1)  # (F, b)
            base = torch.tensor([0.0 if f == ROOT else scores[f] for f in frontier], device=logp.device).unsqueeze(1)  # (F, 1)
            paths = (base + top_logp).flatten()  # (F * b,)
            first = len(scores)
            scores.extend(paths.tolist())
            parent_of.extend(f for f in frontier for _ in range(top_ids.shape[1]))
            token_of.extend(self.output_ids[top_ids.flatten().cpu()].tolist())  # output_ids live on the CPU
            if depth + 1 == k or float(paths.max()) < floor:  # no deeper node could make the tree
                break
            best = paths.topk(min(beam, paths.numel())).indices.tolist()  # next frontier, best first
            parent_rows = [b // top_ids.shape[1] for b in best]  # each one's parent's row
            cache = _select_rows(cache, parent_rows)  # copies: the session's own cache never sees the tree
            step = torch.tensor([[token_of[first + b]] for b in best], dtype=torch.long, device=self.head.device)  # (F', 1)
            inputs = guesses[parent_rows].unsqueeze(1)  # (F', 1, d): the guess each token came from
            guesses = self.head(step, inputs, cache, start=n - 1 + depth)[:, -1]  # (F', d)
            frontier = [first + b for b in best]
        # The tree: the likeliest candidates, ancestors first (a child's path probability is at most
        # its parent's; ties keep creation order, in which a parent comes first).
        order = sorted(range(len(scores)), key=lambda c: (-scores[c], c))
        chosen = sorted(c for c in order[: self.tree_nodes] if scores[c] >= floor)
        # A node whose parent was not chosen cannot be verified: drop it (only ties can cause this).
        kept: dict[int, int] = {}
        for c in chosen:
            if parent_of[c] == ROOT or parent_of[c] in kept:
                kept[c] = len(kept)
        tokens = [token_of[c] for c in kept]
        parents = tuple(ROOT if parent_of[c] == ROOT else kept[parent_of[c]] for c in kept)
        q = [SparseDist.one_hot(t) for t in tokens]
        return Proposal(tokens, q, time.perf_counter() - started, parents=parents)

    def _draft_alternatives(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams) -> Proposal:
        """The chain ``propose`` drafts, then the runner-up leaves (``alternatives``): nodes 0 .. m-1
        are the chain (node i's parent is node i-1), then, depth by depth and best first, each of the
        head's next ``alt_per_depth`` choices there that has at least ``alt_min_prob``, with the chain
        node's parent. The chain comes first, so it is the tree's primary chain
        (specpool/target/tree.py) and the round's BD reward is the chain's."""
        runners_up: list[list[int]] = []
        chain = self._draft(session_id, context_ids, k, params, runners_up)
        tokens, q = list(chain.tokens), list(chain.q)
        parents = [ROOT] + list(range(len(tokens) - 1)) if tokens else []
        for depth, leaves in enumerate(runners_up[: len(tokens)]):
            for token in leaves:
                tokens.append(token)
                # Greedy: one-hot, as the chain's. Sampled: the q the chain's token and the leaves
                # before it were drawn from, which the target's walk reduces by those tokens itself.
                q.append(SparseDist.one_hot(token) if params.greedy else chain.q[depth])
                parents.append(ROOT if depth == 0 else depth - 1)
        return Proposal(tokens, q, chain.forward_s, parents=tuple(parents))

    def propose(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams) -> Proposal:
        started = time.perf_counter()
        proposal = self._draft(session_id, context_ids, k, params)
        self.cost.record(time.perf_counter() - started, len(proposal.tokens))
        return proposal

    @torch.inference_mode()
    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        """``specpool.drafters.base.BatchDrafter``: the chains ``propose`` drafts, for several sessions
        at once. The target hosting this head (``specpool/router/hosted.py``) drafts for every session
        of a verify batch; one after another, each draft step is a forward of one row, and a
        one-block head's forward costs about the same for one row as for eight (it reads its
        weights and the output head's once either way). Here the catch-up is one padded forward
        per group of similar widths (``plan_forwards``: a session's first drafted round, which
        reads its whole prompt, does not widen the others), then each draft step is one forward
        over the sessions still drafting; each stops where ``propose`` would (its k, its
        confidence stop). A session twice in one batch drafts one request after another.

        Each proposal's ``forward_s`` (and the cost meter's record) is an equal share of the
        batch's wall time, so the shares add up to the time spent."""
        if len(requests) < 2 or len({r.session_id for r in requests}) < len(requests):
            return [self.propose(r.session_id, r.context_ids, r.k, r.params) for r in requests]
        started = time.perf_counter()
        unseen = [self._unseen(r.session_id, r.context_ids) if r.k > 0 else None for r in requests]
        rows = [i for i, u in enumerate(unseen) if u is not None]  # requests the head drafts for
        try:
            tokens, q = self._draft_rows(requests, unseen, rows)
        except BaseException:
            for i in rows:  # a half-done batch leaves no cache out of step with its tokens: read again next round
                unseen[i][0].crop(0)
            raise
        share = (time.perf_counter() - started) / len(requests)
        proposals = [Proposal(tokens.get(i, []), q.get(i, []), share if i in tokens else 0.0) for i in range(len(requests))]
        for proposal in proposals:
            self.cost.record(share, len(proposal.tokens))
        return proposals

    def _draft_rows(self, requests: Sequence[DraftRequest], unseen: list, rows: list[int]
                    ) -> tuple[dict[int, list[int]], dict[int, list[SparseDist]]]:
        """``propose_batch``'s drafting: the tokens and q of each request in ``rows``."""
        guesses: dict[int, torch.Tensor] = {}  # request -> the head's current guess (d,)
        for group in plan_forwards([len(unseen[i][1]) for i in rows], HEAD_SPLIT_COST_TOKENS):
            members = [rows[j] for j in group]
            outputs = self._forward_rows([(unseen[i][1], unseen[i][2]) for i in members], [unseen[i][0] for i in members])
            guesses.update(zip(members, outputs))
            for i in members:
                unseen[i][0].tokens.extend(unseen[i][1].tolist())
        tokens: dict[int, list[int]] = {i: [] for i in rows}
        q: dict[int, list[SparseDist]] = {i: [] for i in rows}
        active = list(rows)
        for step in range(max((requests[i].k for i in rows), default=0)):
            logits = self.head.reduced_logits(torch.stack([guesses[i] for i in active]))  # (A, V_r)
            going = []
            for row, i in enumerate(active):
                r = requests[i]
                token, dist, more = self._draw(logits[row], r.params, len(r.context_ids), step, r.k)
                tokens[i].append(token)
                q[i].append(dist)
                if more:
                    going.append(i)
            if not going:
                break
            fed = [(torch.tensor([tokens[i][-1]], device=self.head.device), guesses[i].view(1, -1)) for i in going]
            guesses.update(zip(going, self._forward_rows(fed, [unseen[i][0] for i in going])))
            active = going
        for i in rows:
            unseen[i][0].crop(len(requests[i].context_ids) - 1)  # draft positions read guessed features
        return tokens, q

    def _forward_rows(self, fed: list[tuple[torch.Tensor, torch.Tensor]], sessions: list[HeadSession]) -> list[torch.Tensor]:
        """One padded head forward; ``fed``: each row's tokens (T_i,) and features (T_i, d). Returns
        each row's guess at its last real position (d,)."""
        lengths = [len(ids) for ids, _ in fed]
        width = max(lengths)
        inputs = torch.stack([F.pad(ids, (0, width - len(ids))) for ids, _ in fed])  # (B, T)
        feats = torch.stack([F.pad(f, (0, 0, 0, width - len(f))) for _, f in fed])  # (B, T, d)
        out = self.head.forward_rows(inputs, feats, [s.cache for s in sessions], lengths)  # (B, T, d)
        return [out[row, n - 1] for row, n in enumerate(lengths)]

    def replay(self, session_id: str, context_ids: list[int], continuation: list[int], k: int,
               params: SamplingParams) -> int | None:
        """``specpool.drafters.base.Replayable``: a greedy draft is a function of the context and
        its features, so drafting it again and comparing with the target's tokens is exact. The
        head's cache ends as it was (draft positions cropped)."""
        if not params.greedy:
            raise InvalidArgument("replay needs greedy decoding: a sampled draft is not determined by the context")
        if self.features_held(session_id) < len(context_ids) - 1:
            return None  # no features for this context: it cannot say
        return leading_matches(self._draft(session_id, context_ids, k, params).tokens, continuation)

    def release(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)


@register_drafter(HEAD_KIND)
def _make_eagle(name: str, argument: str, context: DrafterContext) -> EagleDrafter:
    """``eagle:NAME`` (a shipped head) or ``eagle:PATH`` (a trained folder)."""
    return _head_drafter(name, argument, context)


@register_drafter(TREE_KIND)
def _make_eagle_tree(name: str, argument: str, context: DrafterContext) -> EagleDrafter:
    """``eagle-tree:NAME``: the head of ``eagle:NAME`` drafting trees in greedy rounds (chains otherwise)."""
    return _head_drafter(name, argument, context, tree_nodes=DEFAULT_TREE_NODES)


@register_drafter(ALT_KIND)
def _make_eagle_alt(name: str, argument: str, context: DrafterContext) -> EagleDrafter:
    """``eagle-alt:NAME``: the head of ``eagle:NAME`` drafting its chain plus runner-up leaves in
    greedy rounds (``EagleDrafter.alternatives``; chains otherwise)."""
    return _head_drafter(name, argument, context, alternatives=DEFAULT_ALTERNATIVES)


@register_drafter(INT8_KIND)
def _make_eagle_int8(name: str, argument: str, context: DrafterContext) -> EagleDrafter:
    """``eagle-int8:NAME``: the head of ``eagle:NAME`` drafting with int8 kernels for its block and
    output head on a CPU (float32 where this torch has no x86 int8 linear, and on a GPU)."""
    return _head_drafter(name, argument, context, precision="int8")


@register_drafter(ALT_INT8_KIND)
def _make_eagle_alt_int8(name: str, argument: str, context: DrafterContext) -> EagleDrafter:
    """``eagle-alt-int8:NAME``: ``eagle-alt:NAME`` drafting with int8 kernels on a CPU. Side by side
    with ``eagle-alt`` behind prompt lookup (bench/results/white-box-int8-leaves/) it ran 1.03-1.04x
    its tokens/s per prompt, with the same tokens per round within 0.02."""
    return _head_drafter(name, argument, context, precision="int8", alternatives=DEFAULT_ALTERNATIVES)


def _head_drafter(name: str, argument: str, context: DrafterContext, precision: str = "float32",
                  **options) -> EagleDrafter:
    """The head that ``argument`` names, drafting with ``options``; ``name`` is the spec (KIND:ARGUMENT)."""
    if not argument:
        kind = name.partition(":")[0]
        raise InvalidArgument(f"{kind} needs a head name or folder; shipped: {', '.join(shipped_heads()) or 'none'}")
    head, metadata = load_eagle_head(head_folder(argument), context.home, context.target, context.device)
    if precision != head.draft_precision:  # a loaded head drafts in float32
        head.set_draft_precision(precision)
    return EagleDrafter(name, head, metadata, **options)


def _select_rows(cache: KVCache, rows: list[int]) -> KVCache:
    """A new cache whose batch rows are ``cache``'s rows ``rows`` (copies: ``cache`` is untouched)."""
    out = KVCache(len(cache.keys))
    index = torch.tensor(rows, dtype=torch.long, device=cache.keys[0].device)
    out.keys = [k.index_select(0, index) for k in cache.keys]
    out.values = [v.index_select(0, index) for v in cache.values]
    return out
