"""The testing kit (ppo_objectives.testing) and its pytest plugin: factories, references, tiny networks, assertions."""

import math
import subprocess
import sys

import pytest
import torch
from tensordict.nn import TensorDictModuleBase
from torchrl.objectives.value import GAE

from ppo_objectives import KLPenaltyTransform, MaskedGAE, TokenPPOLoss
from ppo_objectives import functional as F
from ppo_objectives import testing as T

pytest_plugins = ["pytester"]

KINDS = T.MASK_KINDS


# --------------------------------------------------------------------------- factories


@pytest.mark.parametrize("factory", [T.response_batch, T.full_sequence_batch, T.collector_batch])
def test_factories_are_seeded(factory):
    a, b, c = factory(seed=3), factory(seed=3), factory(seed=4)
    assert (a == b).all()
    assert not (a == c).all()
    assert (factory(generator=torch.Generator().manual_seed(3)) == a).all()
    assert (factory() == factory(seed=0)).all()
    with pytest.raises(ValueError, match="not both"):
        factory(seed=1, generator=torch.Generator())


@pytest.mark.parametrize("kind", KINDS)
def test_make_mask_kinds(kind):
    m = T.make_mask(10, 7, kind, seed=1)
    assert kind == "all_valid" or not T.make_mask(2, 2, kind, seed=1).all()  # something is masked
    assert m.shape == (10, 7) and m.dtype == torch.bool
    pos = torch.arange(7)
    nonempty = m.any(-1)
    if kind == "all_valid":
        assert m.all()
    elif kind == "right":
        n = m.sum(-1, keepdim=True)
        assert (m == (pos < n)).all() and nonempty.all()
    elif kind == "left":
        n = m.sum(-1, keepdim=True)
        assert (m == (pos >= 7 - n)).all() and nonempty.all()
    elif kind == "holes":
        first = torch.where(m, pos, 7).amin(-1)
        last = torch.where(m, pos, -1).amax(-1)
        inner_hole = ((pos > first[:, None]) & (pos < last[:, None]) & ~m).any(-1)
        assert nonempty.all() and inner_hole.any()
    elif kind == "empty_rows":
        assert (~nonempty).any() and nonempty.any()
    else:  # mixed: every kind is present
        assert m.all(-1).any() and (~nonempty).any()
    with pytest.raises(ValueError, match="not one of"):
        T.make_mask(2, 3, "ragged")


def test_response_batch_keeps_the_layout_contract():
    P, R = 3, 5
    td = T.response_batch(batch_size=6, response_len=R, prompt_len=P, with_advantage=True, seed=0)
    assert td.batch_size == (6,)
    m = td["mask"]
    assert td["input_ids"].shape == td["attention_mask"].shape == (6, P + R)
    assert td["input_ids"].dtype == torch.int64 and td["attention_mask"].dtype == torch.bool
    assert (td["response_ids"] == td["input_ids"][:, P:]).all()
    assert (td["attention_mask"][:, P:] == m).all()  # right padding: the response's real tokens are the mask
    assert td["attention_mask"][:, P - 1].all()  # left-padded prompts of at least one token
    for key in ("sample_log_prob", "token_reward", ("next", "reward"), "state_value", "ref_log_prob", "advantage",
                "value_target"):  # fmt: skip
        x = td[key]
        assert x.shape == (6, R) and x.dtype == torch.float32
        assert (x[~m] == 0).all(), key
    assert (td["sample_log_prob"][m] < 0).all()
    assert (td["terminated"] ^ td["truncated"]).all()
    last = F.last_valid_index(m)
    assert torch.allclose(td["token_reward"].gather(1, last[:, None]).squeeze(1) - td["score"], torch.zeros(6), atol=0.5)
    nan = T.response_batch(masked_fill=float("nan"), seed=0)
    assert nan["sample_log_prob"][~nan["mask"]].isnan().all() and not nan["sample_log_prob"][nan["mask"]].isnan().any()


def test_full_sequence_and_collector_batches_keep_their_layouts():
    td = T.full_sequence_batch(batch_size=5, seq_len=9, seed=2)
    m = td["mask"]
    assert td.batch_size == (5, 9) and td["next", "reward"].shape == (5, 9, 1)
    assert (td["attention_mask"] | ~m).all()  # generated tokens are real tokens
    assert ((td["turn"] >= 0) == m).all()
    done = td["next", "done"].squeeze(-1)
    assert (done <= m).all() and (done.sum(-1) <= 1).all()  # the dialog's flags on one generated token
    flat = T.full_sequence_batch(batch_size=5, seq_len=9, trailing_dim=False, seed=2)
    assert flat["next", "done"].shape == (5, 9) and (flat["next", "done"] == done).all()

    col = T.collector_batch(num_envs=4, steps=12, seed=0)
    d, te, tr = (col["next", k].squeeze(-1) for k in ("done", "terminated", "truncated"))
    assert (d == (te | tr)).all() and not (te & tr).any() and d.any()
    some = T.collector_batch(flags=("terminated",), seed=0)
    assert ("next", "done") not in some.keys(True) and ("next", "terminated") in some.keys(True)
    assert "mask" in T.collector_batch(mask="holes", seed=0).keys()


# --------------------------------------------------------------------------- every module accepts them


def _finite(td, keys):
    for k in keys:
        assert torch.isfinite(td[k]).all(), k


@pytest.mark.parametrize("kind", KINDS)
def test_every_module_accepts_the_response_batch(kind):
    td = T.response_batch(batch_size=5, response_len=6, mask=kind, seed=1)
    gae = MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)
    _finite(gae(td.clone()), ["advantage", "value_target"])
    _finite(KLPenaltyTransform(coeff=0.1)(td.clone()), ["kl_penalty", ("next", "reward")])
    actor, critic = T.tiny_actor_critic()
    out = TokenPPOLoss(actor, critic, entropy_coeff=0.01)(gae(td.clone()))
    _finite(out, [k for k in out.keys() if k.startswith("loss_")])


@pytest.mark.parametrize("kind", ["holes", "right", "mixed"])
def test_every_module_accepts_the_full_sequence_batch(kind):
    td = T.full_sequence_batch(batch_size=4, seq_len=8, mask=kind, with_ref_log_prob=True, seed=1)
    td = KLPenaltyTransform(coeff=0.1)(td)
    td = MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)(td)
    assert td["advantage"].shape == (4, 8, 1)
    actor, critic = T.tiny_actor_critic(layout="full")
    out = TokenPPOLoss(actor, critic, entropy_coeff=0.01)(td)
    _finite(out, [k for k in out.keys() if k.startswith("loss_")])


@pytest.mark.parametrize("mask", [None, "holes"])
@pytest.mark.parametrize("trailing_dim", [True, False])
def test_masked_gae_accepts_the_collector_batch(mask, trailing_dim):
    td = T.collector_batch(num_envs=3, steps=10, mask=mask, trailing_dim=trailing_dim, seed=5)
    out = MaskedGAE(gamma=0.9, lmbda=0.8)(td)
    assert out["advantage"].shape == td["state_value"].shape


# --------------------------------------------------------------------------- references equal the package


@pytest.mark.parametrize("kind", KINDS)
def test_reference_gae_response_equals_masked_gae(kind):
    # masked_gae itself against reference_gae_response: tests/test_functional.py's grid over every kind
    td = T.response_batch(batch_size=6, response_len=9, mask=kind, masked_fill=float("nan"), seed=2)
    adv, target = T.reference_gae_tensordict(td, 1.0, 0.95, average_gae=True)
    out = MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)(td.clone())
    T.assert_matches_reference(out["advantage"], adv, name="MaskedGAE advantage")
    T.assert_matches_reference(out["value_target"], target, name="MaskedGAE value_target")


@pytest.mark.parametrize("flags", [("done", "terminated", "truncated"), ("done",), ("terminated",), ("truncated",),
                                   ("done", "truncated")])  # fmt: skip
@pytest.mark.parametrize("mask", [None, "holes", "mixed"])
def test_reference_gae_collector_equals_masked_gae(flags, mask):
    td = T.collector_batch(num_envs=4, steps=14, mask=mask, flags=flags, done_prob=0.3, seed=3)
    adv, target = T.reference_gae_tensordict(td, 0.95, 0.9)
    out = MaskedGAE(gamma=0.95, lmbda=0.9)(td.clone())
    T.assert_matches_reference(out["advantage"], adv, name="advantage")
    T.assert_matches_reference(out["value_target"], target, name="value_target")
    if mask is None and flags == ("done", "terminated", "truncated"):  # consistent collector data: TorchRL agrees
        theirs = GAE(gamma=0.95, lmbda=0.9, value_network=None)(td.clone())
        T.assert_matches_reference(theirs["advantage"], adv, name="TorchRL GAE advantage")


def test_reference_gae_collector_functional_form():
    td = T.collector_batch(num_envs=3, steps=11, mask="mixed", trailing_dim=False, masked_fill=float("nan"), seed=4)
    args = (td["next", "reward"], td["state_value"])
    done, term = td["next", "done"], td["next", "terminated"]
    nv = td["next", "state_value"]
    want = T.reference_gae_collector(*args, nv, 0.9, 0.7, done=done, terminated=term, mask=td["mask"], average_gae=True)
    got = F.masked_gae(*args, td["mask"], 0.9, 0.7, done=done, terminated=term, next_values=nv, backend="torch")
    T.assert_matches_reference(got[0], want[0], name="advantages")
    T.assert_matches_reference(got[1], want[1], name="returns")


def test_reference_gae_full_sequence_equals_masked_gae():
    td = T.full_sequence_batch(batch_size=5, seq_len=12, masked_fill=float("nan"), seed=6)
    adv, target = T.reference_gae_tensordict(td, 1.0, 0.95, average_gae=True)
    out = MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)(td.clone())
    T.assert_matches_reference(out["advantage"], adv, name="advantage")
    T.assert_matches_reference(out["value_target"], target, name="value_target")


@pytest.mark.parametrize("kind", ["right", "holes", "empty_rows"])
def test_reference_kl_equals_the_functional_core(kind):
    # ppo_policy_loss against reference_ppo_policy_loss: tests/test_functional.py's grid over every kind
    td = T.response_batch(batch_size=6, response_len=7, mask=kind, with_ref_log_prob=True, seed=7)
    m, old, ref = td["mask"], td["sample_log_prob"], td["ref_log_prob"]
    new = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    new = new.clamp(max=0.0)  # log-probs are <= 0
    for est in ("k1", "k2", "k3", "k3+"):
        T.assert_matches_reference(F.masked_kl_estimate(new, ref, m, est), T.reference_kl(new, ref, est, mask=m),
                                   name=est)  # fmt: skip
        T.assert_matches_reference(F.kl_estimate(new, ref, est), T.reference_kl(new, ref, est), name=est)
    T.assert_matches_reference(F.reference_kl_penalty(new, ref, m),
                               T.reference_kl(new, ref, "k3", mask=m).sum() / m.sum().clamp(min=1))  # fmt: skip


def test_reference_log_probs_equal_the_functional_core_in_values_and_gradients():
    # values over dtypes and devices: tests/test_functional.py's test_response_log_probs_equal_naive_gather
    g = torch.Generator().manual_seed(12)
    logits = 2 * torch.randn(3, 9, 11, generator=g)
    ids = torch.randint(0, 11, (3, 9), generator=g)
    pl = torch.tensor([1, 5, 3])
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = F.response_log_probs(a, ids, pl, 4, return_entropy=True)
    want = T.reference_response_log_probs(b, ids, pl, 4, return_entropy=True)
    assert want[0].dtype == torch.float64 and want[0].shape == (3, 4)
    for x, y, name in zip(got, want, ("log-probs", "entropies")):
        T.assert_matches_reference(x, y, name=name)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64)
    ((got[0] * w).sum() + (got[1] * w.flip(-1)).sum()).backward()
    ((want[0] * w).sum() + (want[1] * w.flip(-1)).sum()).backward()
    T.assert_matches_reference(a.grad, b.grad, atol=1e-5, name="gradient")
    # the response form scores input_ids[b, p + 1] from logits[b, p]: the plain form on those rows
    p = pl[:, None] - 1 + torch.arange(4)
    rows = logits[torch.arange(3)[:, None], p]
    T.assert_matches_reference(T.reference_log_probs(rows, ids.gather(1, p + 1)), want[0], name="plain form")


def test_reference_log_probs_golden_case_and_errors():
    logp, ent = T.reference_log_probs(torch.zeros(2, 4), torch.tensor([3, 0]), return_entropy=True)
    T.assert_matches_reference(logp, torch.full((2,), -math.log(4)), name="log(1/4)")
    T.assert_matches_reference(ent, torch.full((2,), math.log(4)), name="log 4")
    assert T.reference_log_probs(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long)).shape == (0,)
    with pytest.raises(ValueError, match=r"targets has shape \(3,\), expected \(2,\)"):
        T.reference_log_probs(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"targets holds 4, outside \[0, V = 4\)"):
        T.reference_log_probs(torch.zeros(2, 4), torch.tensor([0, 4]))
    with pytest.raises(TypeError, match="targets must be an integer tensor"):
        T.reference_log_probs(torch.zeros(2, 4), torch.zeros(2))
    with pytest.raises(ValueError, match=r"row 0: response token 2 sits at column 4, outside the T = 4 columns"):
        T.reference_response_log_probs(torch.zeros(1, 4, 3), torch.zeros(1, 4, dtype=torch.long), torch.tensor([2]), 3)


# --------------------------------------------------------------------------- tiny networks


@pytest.mark.parametrize("layout", ["response", "full"])
def test_tiny_actor_critic_is_deterministic_and_trains(layout):
    make = T.response_batch if layout == "response" else T.full_sequence_batch
    td = make(seed=0, with_ref_log_prob=True)
    a1, c1 = T.tiny_actor_critic(layout=layout, seed=1)
    a2, _ = T.tiny_actor_critic(layout=layout, seed=1)
    assert (a1(td.clone())["log_prob"] == a2(td.clone())["log_prob"]).all()
    out = a1(td.clone())
    logp, ent = out["log_prob"], out["entropy"]
    assert (logp <= 0).all() and (ent >= 0).all()
    if layout == "response":  # the alignment of ResponseLogProbs: token j given input_ids[:, P + j - 1]
        P = td["input_ids"].shape[1] - td["response_ids"].shape[1]
        j = 2
        want = T.reference_log_probs(a1.module.logits.detach()[td["input_ids"][:, P + j - 1]], td["response_ids"][:, j])
        assert torch.allclose(logp[:, j], want.float())
    td = MaskedGAE(gamma=1.0, lmbda=0.95)(td)
    loss = TokenPPOLoss(a1, c1)
    out = loss(td)
    sum(v for k, v in out.items() if k.startswith("loss_")).backward()
    grads = [p.grad for p in loss.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    with pytest.raises(ValueError, match="vocab_size"):
        T.tiny_actor_critic(vocab_size=4, layout=layout)[0](td.clone())


# --------------------------------------------------------------------------- assert_mask_invariant


@pytest.mark.parametrize("kind", ["right", "holes", "empty_rows", "mixed"])
def test_package_modules_are_mask_invariant(kind):
    td = T.response_batch(batch_size=6, response_len=7, mask=kind, seed=8)
    rep = T.assert_mask_invariant(MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True), td)
    assert rep.zero_checked == [("advantage",), ("value_target",)] and rep.masked_positions == int((~td["mask"]).sum())
    T.assert_mask_invariant(KLPenaltyTransform(coeff=0.1, estimator="k3"), td)
    actor, critic = T.tiny_actor_critic()
    rep = T.assert_mask_invariant(TokenPPOLoss(actor, critic, entropy_coeff=0.01), td)
    assert ("loss_objective",) in rep.outputs and ("max_ratio",) in rep.outputs and not rep.zero_checked
    T.assert_mask_invariant(actor, td, zero_at_masked=False)  # the actor reads token ids only


def test_collector_and_full_sequence_forms_are_mask_invariant():
    col = T.collector_batch(num_envs=4, steps=12, mask="holes", seed=9)
    rep = T.assert_mask_invariant(MaskedGAE(gamma=0.9, lmbda=0.8), col)
    assert ("next", "done") in rep.corrupted and ("next", "state_value") in rep.corrupted
    full = T.full_sequence_batch(batch_size=4, seq_len=10, with_ref_log_prob=True, seed=9)
    T.assert_mask_invariant(MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True), full)
    actor, critic = T.tiny_actor_critic(layout="full")
    T.assert_mask_invariant(TokenPPOLoss(actor, critic), MaskedGAE(gamma=1.0, lmbda=0.95)(full))


class _LeakyCentring(TensorDictModuleBase):
    """Centres the reward with a plain mean over every token, padding included: masked entries leak."""

    in_keys = [("next", "reward")]
    out_keys = [("next", "reward")]

    def forward(self, td):
        r = td["next", "reward"]
        td["next", "reward"] = torch.where(td["mask"], r - r.mean(), 0.0)
        return td


class _NonzeroPadding(TensorDictModuleBase):
    """Adds a length bonus to every token, padding included: valid outputs are right, masked ones are not 0."""

    in_keys = [("next", "reward")]
    out_keys = [("next", "reward")]

    def forward(self, td):
        td["next", "reward"] = torch.where(td["mask"], td["next", "reward"], 0.0) + 0.1
        return td


class _ReadsMaskedFlags(TensorDictModuleBase):
    """Counts done flags over every step, masked ones included."""

    in_keys = [("next", "done")]
    out_keys = ["n_done"]

    def forward(self, td):
        td["n_done"] = td["next", "done"].sum(-2).float().expand(td.batch_size).clone()
        return td


def test_assert_mask_invariant_catches_leaky_modules():
    td = T.response_batch(batch_size=4, response_len=6, seed=10)
    with pytest.raises(AssertionError, match=r"NaN at masked positions of the inputs changed output \('next', 'reward'\)"):
        T.assert_mask_invariant(_LeakyCentring(), td)
    with pytest.raises(AssertionError, match=r"not 0 at masked positions with the clean batch.*first 0.1"):
        T.assert_mask_invariant(_NonzeroPadding(), td)
    T.assert_mask_invariant(_NonzeroPadding(), td, zero_at_masked=False)  # valid outputs do not leak
    col = T.collector_batch(num_envs=3, steps=8, mask="holes", seed=10)
    with pytest.raises(AssertionError, match=r"random garbage .* changed output \('n_done',\)"):
        T.assert_mask_invariant(_ReadsMaskedFlags(), col, zero_at_masked=False)
    rep = T.assert_mask_invariant(_LeakyCentring(), td, corrupt_keys=["state_value"], out_keys=[("next", "reward")])
    assert rep.corrupted == [("state_value",)]  # the reward alone is read: corrupting something else is harmless
    with pytest.raises(ValueError, match="only per-token entries"):
        T.assert_mask_invariant(_LeakyCentring(), td, corrupt_keys=["score"])
    with pytest.raises(ValueError, match="no masked position"):
        T.assert_mask_invariant(MaskedGAE(gamma=1.0, lmbda=1.0), T.response_batch(mask="all_valid"))
    with pytest.raises(KeyError, match="no mask"):
        T.assert_mask_invariant(MaskedGAE(gamma=1.0, lmbda=1.0), T.collector_batch())


# --------------------------------------------------------------------------- assert_matches_reference


def test_assert_matches_reference_messages():
    want = torch.zeros(2, 3, dtype=torch.float64)
    got = torch.zeros(2, 3)
    T.assert_matches_reference(got, want)
    got[1, 2] = 0.5
    got[0, 1] = 1e-3
    with pytest.raises(AssertionError) as err:
        T.assert_matches_reference(got, want, name="advantage")
    msg = str(err.value)
    assert "advantage does not match the reference: 2 of 6 entries differ" in msg
    assert "largest absolute error 0.5 at [1, 2] (got 0.5, want 0)" in msg
    T.assert_matches_reference(got, want, mask=torch.tensor([[True, False, True], [True, True, False]]))
    with pytest.raises(AssertionError, match=r"shape \(2, 3\) but the reference has shape \(2, 3, 1\)"):
        T.assert_matches_reference(got, want.unsqueeze(-1))
    nan = torch.tensor([1.0, float("nan"), float("inf")])
    T.assert_matches_reference(nan, nan.clone())
    with pytest.raises(AssertionError, match=r"1 non-finite mismatch\(es\), first at \[1\] \(got nan, want 2.0\)"):
        T.assert_matches_reference(nan, torch.tensor([1.0, 2.0, float("inf")]))
    T.assert_matches_reference(torch.tensor(1.0), 1.0)
    with pytest.raises(AssertionError) as err:  # every failing entry has want == 0: no relative error to report
        T.assert_matches_reference(torch.tensor([0.0, 0.1]), torch.zeros(2))
    assert "largest absolute error 0.1 at [1]" in str(err.value) and "relative" not in str(err.value)


def test_float64_batches_match_the_references_tightly():
    td = T.response_batch(mask="holes", dtype=torch.float64, with_advantage=True, seed=11)
    assert td["state_value"].dtype == torch.float64
    out = MaskedGAE(gamma=0.99, lmbda=0.9, average_gae=True)(td.clone())
    adv, target = T.reference_gae_tensordict(td, 0.99, 0.9, average_gae=True)
    T.assert_matches_reference(out["advantage"], adv, atol=1e-10, rtol=1e-10)
    T.assert_matches_reference(out["value_target"], target, atol=1e-10, rtol=1e-10)


# --------------------------------------------------------------------------- the pytest plugin


USER_TEST = '''
import torch

def test_fixtures_without_imports(ppo_response_batch, ppo_full_sequence_batch, ppo_collector_batch,
                                  ppo_tiny_actor_critic, ppo_testing):
    actor, critic = ppo_tiny_actor_critic
    assert ppo_response_batch.batch_size == (4,)
    assert ppo_full_sequence_batch["next", "done"].shape[-1] == 1
    assert ("next", "truncated") in ppo_collector_batch.keys(True)
    ppo_testing.assert_mask_invariant(actor, ppo_response_batch, zero_at_masked=False)

def test_mask_kinds(ppo_mask_kind, ppo_masked_response_batch, ppo_testing):
    assert ppo_mask_kind in ppo_testing.MASK_KINDS
    assert ppo_masked_response_batch["mask"].shape == (4, 6)
    actor, _ = ppo_testing.tiny_actor_critic()
    ppo_testing.assert_mask_invariant(actor, ppo_masked_response_batch, zero_at_masked=False)

def test_generator(ppo_generator):
    assert isinstance(ppo_generator, torch.Generator)
'''


QUIET = ("-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest")  # hypothesis' plugin costs a second a run


def test_the_installed_plugin_gives_fixtures_with_no_setup(pytester):
    pytester.makepyfile(test_user=USER_TEST)  # no conftest.py, no import, no -p: the pytest11 entry point
    result = pytester.runpytest(*QUIET)
    result.assert_outcomes(passed=2 + len(KINDS) - 1)  # every kind but all_valid
    result = pytester.runpytest(*QUIET, "-p", "no:ppo_objectives", "-k", "generator")
    result.assert_outcomes(errors=1)  # switched off by its entry-point name
    result.stdout.fnmatch_lines(["*fixture 'ppo_generator' not found*"])


def test_importing_the_plugin_imports_no_torch():
    # pytest imports the plugin in every session of the environment: it must not cost torch's seconds there
    heavy = "{'torch', 'tensordict', 'ppo_objectives'}"
    code = f"import sys, ppo_objectives_pytest; print(sorted({heavy} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_a_session_that_uses_no_fixture_never_imports_the_kit(pytester):
    pytester.makepyfile(test_other="""
        import sys

        def test_nothing_heavy_was_imported(request):
            assert request.config.pluginmanager.has_plugin("ppo_objectives")
            assert not {"torch", "ppo_objectives"} & set(sys.modules)
    """)
    pytester.runpytest_subprocess(*QUIET).assert_outcomes(passed=1)  # a fresh interpreter: nothing imported yet
