"""The other papers' variants of SPELL's choices: a library spell.py looks up by config key.

spell.py holds the paper's own choice at every switch site and merges the entries below into its
dict, so a reader of spell.py sees every choice, and a variant from another paper is one function
and one dict entry here:

  QUESTIONER_MAPPINGS (reward.questioner_mapping)  r_que other than Eq. 7's Gaussian: Absolute
                                                   Zero, R-Zero (SPELL §5.4), SPICE
  ADVANTAGES (train.advantage)                     A_i other than Eq. 8's z-score: Dr.GRPO's mean,
                                                   QwenLong-L1.5's task std, GoLongRL's task mean
  LOSS_NORMS (train.loss_norm)                     Eq. 12's normaliser other than per group: DAPO's
                                                   token mean, GRPO's sequence mean, Dr.GRPO's and
                                                   SPICE's constants
  POLICY_LOSSES (train.policy_loss)                objectives other than Eq. 2: GSPO, CISPO
  ROLLOUT_CORRECTIONS (train.rollout_correction)   vLLM's sampler vs the trainer: truncated
                                                   importance sampling, token and sequence masks
  overlong_penalty (reward.overlong_buffer)        DAPO's soft overlong punishment
  AEPO, aepo_batch (train.aepo)                    QwenLong-L1.5's entropy hysteresis, and the
                                                   entropies its bounds can meet (AEPO_LOW_MIN,
                                                   AEPO_HIGH_MAX, max_entropy)

Each entry takes exactly what SPELL's entry of its dict takes, so they swap freely; how each one
differs from its own paper is in docs/reference.md. This file imports no other file of the project
and reads no config: spell.py passes every value in.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch




# ==================================================================================================
# The questioner's reward r_que from the responders' mean reward r (SPELL Eq. 7's alternatives)
# ==================================================================================================

def azr_mapping(r: float, mu: float, sigma: float) -> float:
    """Absolute Zero's learnability reward (Zhao et al. 2025; compared in SPELL §5.4, formula as
    SPICE App. 8 / Fig. 7 states it): 1 - r, 0 when nobody or everybody solved it."""
    if r <= 0.0 or r >= 1.0:
        return 0.0
    return 1.0 - r


def rzero_mapping(r: float, mu: float, sigma: float) -> float:
    """R-Zero's uncertainty reward (Huang et al. 2025; compared in SPELL §5.4, formula as SPICE
    App. 8 / Fig. 7 states it): 1 - 2|r - 0.5|. R-Zero's p is the share of answers agreeing with
    their majority vote; here it is r, the mean responder reward, as in SPELL's §5.4 comparison.
    0 at r = 0 and r = 1 by itself."""
    return 1.0 - 2.0 * abs(r - 0.5)


def spice_mapping(r: float, mu: float, sigma: float) -> float:
    """SPICE's variance reward (arXiv:2510.24684, §2.2 Eq. 1 = App. 10 Eq. 5):
    exp(-(Var - 0.25)^2 / (2 * 0.01)) with Var = r(1 - r), the population variance of G binary
    rewards (App. 10 writes sigma^2 = p(1 - p)). The paper has no zero case: r = 0 or 1 earns
    exp(-3.125) = 0.044, so under this mapping such a question counts as solvable (r_que > 0:
    history memory, not a §4.3 negative)."""
    # Eq. 6's r_i are 0 or 1, so this is Var({r_i}); SPICE's own constants below
    variance = r * (1.0 - r)
    return math.exp(-((variance - 0.25) ** 2) / (2 * 0.01))


# reward.questioner_mapping: SPELL §5.4 / Figure 5 compares gaussian (spell.py), azr and rzero;
# SPICE §4.3 / Table 4 compares azr, rzero and spice. Each takes (r, mu, sigma); only the Gaussian
# reads mu and sigma
QUESTIONER_MAPPINGS: dict[str, Callable[[float, float, float], float]] = {
    "azr": azr_mapping, "rzero": rzero_mapping, "spice": spice_mapping}


def overlong_penalty(length: int, max_len: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025): 0 up to max_len - buffer tokens, then
    falling linearly to -1 at max_len (where vLLM cuts the generation)."""
    start = max_len - buffer
    return 0.0 if buffer <= 0 or length <= start else max(-1.0, (start - length) / buffer)


# ==================================================================================================
# Advantages other than Eq. 8's z-score (train.advantage)
# ==================================================================================================

def mean_advantages(rewards: torch.Tensor, task: Sequence[torch.Tensor] = (),
                    eps: float = 1e-6) -> torch.Tensor:
    """Dr.GRPO (SPICE §2.4): A_i = r_i - mean, no division by the std, so a nearly unanimous group
    is not scaled up. (n,) -> (n,)."""
    return rewards - rewards.mean()


def task_std_advantages(rewards: torch.Tensor, task: Sequence[torch.Tensor] = (),
                        eps: float = 1e-6) -> torch.Tensor:
    """QwenLong-L1.5 §4.2, Eq. 7: A_i = (r_i - mean of the group) / (std of the rewards of every
    sample of the group's task in the batch + eps). Unbiased std over the task's samples pooled
    (their code's torch.std); a group of one has no baseline (departure 7). (n,) -> (n,)."""
    if len(rewards) < 2:
        return torch.zeros_like(rewards)
    pooled = torch.cat(list(task)) if len(task) else rewards  # (samples of the task,)
    return (rewards - rewards.mean()) / (pooled.std(correction=1) + eps)


def task_mean_advantages(rewards: torch.Tensor, task: Sequence[torch.Tensor] = (),
                         eps: float = 1e-6) -> torch.Tensor:
    """GoLongRL's task-level mean normalisation (TMN, its difficulty reweighting off): A_i =
    (r_i - mean of the group) / (sqrt(the mean over the task's groups of each group's unbiased
    variance) + eps), each group weighing the same. A group of one has no baseline (departure 7)
    and no variance, so it is left out of the mean (GoLongRL counts it as variance 1). (n,) -> (n,).
    """
    if len(rewards) < 2:
        return torch.zeros_like(rewards)
    variances = [g.var(correction=1) for g in (task if len(task) else [rewards]) if len(g) > 1]
    scale = torch.stack(variances).mean().sqrt()  # the task's root mean group variance
    return (rewards - rewards.mean()) / (scale + eps)


# train.advantage: each takes a group's rewards and the rewards of every group of its task in the
# batch, as spell.zscore_advantages does
ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {
    "mean": mean_advantages, "task_std": task_std_advantages, "task_mean": task_mean_advantages}


# ==================================================================================================
# Loss normalisers other than Eq. 12's per group (train.loss_norm)
# ==================================================================================================

def token_norm(lengths: Sequence[int], groups: Sequence[Any], roles: Sequence[str],
               max_len: int) -> list[float]:
    """DAPO's token mean: 1 / all tokens of the batch; roles weigh by their token counts."""
    return [1.0 / sum(lengths)] * len(lengths)


def sequence_norm(lengths: Sequence[int], groups: Sequence[Any], roles: Sequence[str],
                  max_len: int) -> list[float]:
    """GRPO's Eq. 2: 1 / (|y_i| * #sequences), every sequence counts the same."""
    return [1.0 / (n * len(lengths)) for n in lengths]


def constant_norm(lengths: Sequence[int], groups: Sequence[Any], roles: Sequence[str],
                  max_len: int) -> list[float]:
    """Dr.GRPO (SPICE §2.4): 1 / (max_len * #sequences), a constant in place of |y_i|, so that no
    length bias enters; max_len is rollout.max_new_tokens for every role, whatever its budget."""
    if max_len < 1:
        raise ValueError("constant_norm needs max_len >= 1")
    return [1.0 / (max_len * len(lengths))] * len(lengths)


def role_constant_norm(lengths: Sequence[int], groups: Sequence[Any], roles: Sequence[str],
                       max_len: int) -> list[float]:
    """SPICE (§2.4, Eq. 2): Dr.GRPO's constant normaliser within each role, max_len x the role's
    number of sequences, the roles added up: each role's objective is its own mean, as Eq. 2 sums
    one expectation per role. SPICE's batch holds G Challenger and G Reasoner trajectories per
    document (its Alg. 1), so its one constant splits the objective just so; with every question of
    every round training the Challenger (reward.questioner_pool = "all") and at most
    train.batch_groups groups the Reasoner, one constant (constant_norm) would hand the Challenger
    a share that grows with the rounds. Here a role's share is its mean length over the sum of the
    roles' mean lengths, SPICE's split, whatever the counts."""
    if roles is None or len(roles) != len(lengths):
        raise ValueError("role_constant_norm needs the role of every sequence")
    if max_len < 1:
        raise ValueError("role_constant_norm needs max_len >= 1")
    count = {role: list(roles).count(role) for role in set(roles)}
    return [1.0 / (max_len * count[role]) for role in roles]


# train.loss_norm: each maps the batch's sequences to per-sequence token weights (spell.group_norm)
LOSS_NORMS: dict[str, Callable[..., list[float]]] = {
    "token": token_norm, "sequence": sequence_norm, "constant": constant_norm,
    "role_constant": role_constant_norm}


# ==================================================================================================
# Policy objectives other than Eq. 2 (train.policy_loss)
# ==================================================================================================

def sequence_mean(values: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """The mean of `values` over each token's sequence, at every token of it; 0 outside every
    sequence (seq_ids -1). Differentiable. (T,), (T,) -> (T,)."""
    on = seq_ids >= 0  # (T,)
    ids = seq_ids.clamp(min=0)
    n = int(seq_ids.max()) + 1 if on.any() else 1
    masked = torch.where(on, values, torch.zeros_like(values))
    sums = masked.new_zeros(n).index_add(0, ids, masked)  # (n,)
    counts = masked.new_zeros(n).index_add(0, ids, on.to(masked.dtype))
    return torch.where(on, (sums / counts.clamp(min=1))[ids], torch.zeros_like(values))



def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              weights: torch.Tensor, seq_ids: torch.Tensor, clip_low: float = 0.2,
              clip_high: float = 0.2) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): one ratio per sequence, s_i = exp(mean over its tokens of
    log rho_t), clipped as in Eq. 2, so a sequence is kept or clipped whole. GSPO's own clip range
    is about 3e-4 / 4e-4 (train.clip_low / clip_high). With train.loss_norm = "sequence" this is
    GSPO's objective exactly; other normalisers weigh each sequence by its tokens' weights."""
    ratio = torch.exp(sequence_mean(logp - old_logp, seq_ids))  # (T,) s_i at every token of i
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -(torch.minimum(unclipped, clipped) * weights).sum()  # Eq. 2's pessimistic bound on s_i
    return loss, clip_counts(clipped < unclipped, weights)


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
               weights: torch.Tensor, seq_ids: torch.Tensor, clip_low: float = 0.2,
               clip_high: float = 0.2) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2025): every token's log-likelihood gradient, weighted by its importance
    ratio clipped to [1 - clip_low, 1 + clip_high] and detached. Unlike Eq. 2's min, a clipped
    token still trains; only its weight is bounded. MiniMax-M1 clips the upper side only (take
    clip_low close to 1)."""
    ratio = torch.exp(logp - old_logp).detach()  # (T,)
    capped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -(capped * advantages * logp * weights).sum()
    return loss, clip_counts(capped != ratio, weights)


def clip_counts(clipped: torch.Tensor, weights: torch.Tensor) -> dict[str, float]:
    """How many tokens train (weight > 0) and how many of them the clip bound (train/clipfrac), as
    spell.clipped_objective counts them. (T,), (T,) -> counts."""
    active = weights > 0
    return {"clipped": float((clipped & active).sum()), "active": float(active.sum())}


# train.policy_loss: each takes what spell.grpo_loss takes and returns (loss, clip counts)
POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {
    "gspo": gspo_loss, "cispo": cispo_loss}

# those whose on-policy gradient does not move with log pi (spell.LINEAR_POLICY_LOSSES)
LINEAR_POLICY_LOSSES = {"gspo", "cispo"}


# ==================================================================================================
# Rollout corrections: vLLM's sampler against the trainer (train.rollout_correction)
# ==================================================================================================

def tis_correction(log_rho: torch.Tensor, seq_ids: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: min(rho_t, C). (T,) -> (T,)."""
    return log_rho.exp().clamp(max=cap)


def mask_correction(log_rho: torch.Tensor, seq_ids: torch.Tensor, cap: float) -> torch.Tensor:
    """1 where 1/C <= rho_t <= C, else 0: the token leaves the loss. (T,) -> (T,)."""
    rho = log_rho.exp()
    return ((rho >= 1.0 / cap) & (rho <= cap)).to(rho.dtype)


def sequence_kept(log_rho: torch.Tensor, seq_ids: torch.Tensor, cap: float) -> torch.Tensor:
    """1 at every token of a sequence whose geometric mean ratio, exp(mean_t log rho_t), lies in
    [1/C, C], else 0: the sequence is kept or rejected whole. (T,) -> (T,)."""
    mean_log_rho = sequence_mean(log_rho, seq_ids)  # (T,) log of the geometric mean
    return (mean_log_rho.abs() <= math.log(cap)).to(log_rho.dtype)


def seq_mask_correction(log_rho: torch.Tensor, seq_ids: torch.Tensor, cap: float) -> torch.Tensor:
    """The sequence-level mask (the level TRL's rejection defaults to): sequence_kept. (T,) ->
    (T,)."""
    return sequence_kept(log_rho, seq_ids, cap)


def seq_mask_tis_correction(log_rho: torch.Tensor, seq_ids: torch.Tensor,
                            cap: float) -> torch.Tensor:
    """NeMo-RL's seq-mask-tis: the sequence-level mask, and min(rho_t, C) on the kept sequences'
    tokens. (T,) -> (T,)."""
    return sequence_kept(log_rho, seq_ids, cap) * tis_correction(log_rho, seq_ids, cap)


# train.rollout_correction: each maps (log rho, sequence ids, C) to a factor on each token's weight
ROLLOUT_CORRECTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "tis": tis_correction, "mask": mask_correction, "seq_mask": seq_mask_correction,
    "seq_mask_tis": seq_mask_tis_correction}


# ==================================================================================================
# AEPO: QwenLong-L1.5's entropy hysteresis (train.aepo)
# ==================================================================================================

# Where AEPO's bounds can mean something: the batch entropy H (Eq. 11, in nats) is a mean of
# entropies of distributions over the model's V logits, so 0 <= H <= ln V (uniform). A high at or
# past ln V never starts masking; token ids are 32-bit (tokenizers, vLLM), so without the model
# V < 2^32 and H < 32 ln 2 = 22.18. Below, each token's entropy comes out of fp32 (lse - E_p[z],
# kernels/logprob.py; -sum p log p, its torch twin) exact only to about fp32's epsilon, 1.2e-7, near
# a peaked distribution's 0: under 1e-6, ten such roundings, rounding and not the policy would
# decide whether H fell below low, and masking would last for good.
AEPO_LOW_MIN = 1e-6
AEPO_HIGH_MAX = 32 * math.log(2)


def max_entropy(vocab_size: int) -> float:
    """ln V: the largest entropy of a distribution over V logits (the uniform one), in nats."""
    return math.log(vocab_size)


class AEPO:
    """QwenLong-L1.5 §4.4, AEPO, with the rule as its authors settled it after the paper (source in
    docs/reference.md): a hysteresis on the batch entropy H (Eq. 11). Once H exceeds `high`, every
    sample with a negative advantage leaves the batch (aepo_batch); they stay out until H falls
    below `low`.

    H is known only after an update, from the update's own per-token entropies over the samples it
    trained: the state that step t's H sets applies to step t+1's batch. (verl, the authors'
    framework, measures H over the whole batch in a log-prob pass before the update, which an
    on-policy step here does not run.) Bounds (0, 0): off, never masking. The state goes into the
    checkpoint (run_state), so a resumed run masks as the uninterrupted one.
    """

    def __init__(self, low: float, high: float):
        self.low, self.high, self.masking = low, high, False

    def observe(self, entropy: float) -> None:
        """The state after an update whose batch entropy (Eq. 11) was `entropy`."""
        if self.high <= 0:
            return
        if entropy > self.high:
            self.masking = True
        elif entropy < self.low:
            self.masking = False

    def state_dict(self) -> dict:
        return {"masking": self.masking}

    def load_state_dict(self, state: dict) -> None:
        """The state state_dict saved; ValueError, saying what it holds instead, for any other."""
        masking = state.get("masking") if isinstance(state, dict) else None
        if not isinstance(masking, bool):
            raise ValueError(f"AEPO's state must be {{'masking': True or False}}, got "
                             f"{repr(state)[:80]}")
        self.masking = masking


def aepo_batch(items: list, masking: bool) -> list:
    """AEPO's mask (§4.4): while masking, the samples with A_i < 0 leave the batch, so the loss
    normaliser (loss_weights) is the one of the kept samples, as in the authors' code, which drops
    them from the batch before the update."""
    return [it for it in items if not (masking and it.advantage < 0)]


def batch_entropy_sum(entropy: torch.Tensor, seq_ids: torch.Tensor) -> float:
    """Eq. 11 before its division by |B|: every sequence's mean token entropy, added up
    (update_policy adds it over micro-batches and ranks, and divides by the sequences). (T,), (T,)
    -> a number."""
    on = (seq_ids >= 0).float()  # (T,)
    values = entropy.detach().float() * on
    ids, n = seq_ids.clamp(min=0), len(seq_ids) + 1  # n: more than any id, no data-dependent shape
    sums = values.new_zeros(n).index_add(0, ids, values)  # (n,)
    counts = values.new_zeros(n).index_add(0, ids, on)
    return float((sums / counts.clamp(min=1)).sum())  # a sequence without tokens adds 0
