"""Tests of recipes.py that call a variant directly, in recipes.py's order: DAPO's soft overlong
penalty, AEPO's hysteresis and the batch entropy it reads. Hand-worked values, all in the fast tier.

Every entry of the dicts spell.py merges (QUESTIONER_MAPPINGS, ADVANTAGES, LOSS_NORMS,
POLICY_LOSSES, ROLLOUT_CORRECTIONS) is tested in test_spell.py, at spell.py's switch sites: the
checks a correct new entry must pass, and the worked values keyed by name.
"""

import pytest
import torch

import infra
import recipes
import spell


# ------------------------------------------------------------------------------------------------
# DAPO's soft overlong penalty (reward.overlong_buffer)
# ------------------------------------------------------------------------------------------------

def test_overlong_penalty_worked_values():
    """DAPO's soft overlong punishment with max 100 tokens and a buffer of 20."""
    assert ([recipes.overlong_penalty(n, 100, 20) for n in (10, 80, 85, 90, 100)]
            == [0.0, 0.0, -0.25, -0.5, -1.0])
    assert recipes.overlong_penalty(100, 100, 0) == 0.0


# ------------------------------------------------------------------------------------------------
# AEPO: QwenLong-L1.5's entropy hysteresis (train.aepo)
# ------------------------------------------------------------------------------------------------

# AEPO (QwenLong-L1.5 §4.4) on a worked run of batch entropies, bounds [0.5, 1.0]: the state after
# each update. 1.0 is not above high and 0.5 not below low, so neither switches; the paper's first
# code (mask while low < H < high, no memory) would mask at 0.8, 0.9, 0.6 and 0.7 instead.
AEPO_ENTROPIES = [0.8, 1.0, 1.2, 0.9, 0.6, 0.5, 0.4, 0.7, 1.1]
AEPO_MASKING = [False, False, True, True, True, True, False, False, True]


def test_aepo_hysteresis_on_a_worked_entropy_run():
    """Masking starts once an update's entropy exceeds the upper bound and lasts until one falls
    below the lower bound; at [0, 0] it never starts."""
    aepo, off = recipes.AEPO(0.5, 1.0), recipes.AEPO(0.0, 0.0)
    states = []
    for h in AEPO_ENTROPIES:
        aepo.observe(h)
        off.observe(h * 100)
        states.append(aepo.masking)
        assert not off.masking
    assert states == AEPO_MASKING


def test_batch_entropy_is_the_mean_over_sequences_of_their_mean():
    """QwenLong-L1.5 Eq. 11 before / |B|: token entropies 1, 1, 1, 3 (mean 1.5) and 2 (mean 2), and
    a token outside every sequence, sum 3.5; so H = 1.75, where the token mean is 8 / 5 = 1.6."""
    entropy = torch.tensor([1.0, 1.0, 1.0, 3.0, 2.0, 9.0])
    assert recipes.batch_entropy_sum(entropy, torch.tensor([0, 0, 0, 0, 1, -1])) == 3.5
    m = spell.train_metrics({"entropy_sum": 8.0, "tokens": 5, "seq_entropy_sum": 3.5, "seqs": 2}, 2)
    assert m["train/batch_entropy"] == 1.75 and m["train/entropy"] == 1.6
    assert "train/seq_entropy_sum" not in m and "train/seqs" not in m


@pytest.mark.parametrize("state", [{}, {"masking": "yes"}, {"masking": 1}, [True], None])
def test_aepo_refuses_a_state_it_did_not_save(state):
    """An edited checkpoint's AEPO entry is a ValueError naming what it holds (spell.start_or_resume
    turns it into one line naming the file), not a KeyError deep in the resume."""
    aepo = recipes.AEPO(0.5, 1.0)
    with pytest.raises(ValueError, match="AEPO's state must be"):
        aepo.load_state_dict(state)
    aepo.load_state_dict({"masking": True})
    assert aepo.masking is True and aepo.state_dict() == {"masking": True}


def test_aepo_bounds_are_entropies_a_batch_can_have():
    """The range AEPO's bounds may take: the batch entropy H (Eq. 11, nats) lies in [0, ln V], and
    fp32 computes a token's entropy only to about 1e-7 near 0. Hand-worked: ln 2^32 = 22.18."""
    assert recipes.AEPO_LOW_MIN == 1e-6
    assert recipes.AEPO_HIGH_MAX == pytest.approx(22.1807, abs=1e-4)  # 32 ln 2
    assert recipes.max_entropy(1000) == pytest.approx(6.9078, abs=1e-4)  # ln 1000
    # a uniform distribution over V reaches it: the bound is the largest value, not a guess
    logits = torch.zeros(1000)
    p = logits.softmax(-1)
    assert float(-(p * p.log()).sum()) == pytest.approx(recipes.max_entropy(1000), rel=1e-6)


@pytest.mark.parametrize("bounds", ["1e-300,1", "5e-7,0.2", "100,200", "0.1,22.5"])
def test_aepo_bounds_no_batch_can_meet_are_refused_at_load(bounds):
    """[1e-300, 1] masks for good, as the refused low of 0 did (no fp32 entropy falls below it),
    and [100, 200] never starts masking (no vocabulary's entropy reaches 100 nats): both stop at
    load, naming the key."""
    with pytest.raises(infra.ConfigError, match=r"^train\.aepo must be \[low, high\] with 0 < low "
                                                 r"<= high.*>= 1e-06.*< 22\.18"):
        spell.load_config(None, [f"--train.aepo={bounds}"])


@pytest.mark.parametrize("argv", [["--train.aepo=1e-6,1e-6"], ["--train.aepo=0,0"],
                                  ["--train.aepo=0.5,22"], []])
def test_aepo_bounds_the_recipes_use_still_load(argv):
    """The QwenLong-L1.5 preset's [0.15, 0.25], its end-to-end test's [1e-6, 1e-6] (masking from
    step 2 on), off, and a high just below ln 2^32."""
    spell.load_config([str(spell.ROOT / "config.toml"),
                       str(spell.ROOT / "presets" / "qwenlong_l15.toml")], argv)
