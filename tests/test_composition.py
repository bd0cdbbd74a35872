"""The three components together: KL penalty -> MaskedGAE -> replay buffer minibatches -> TokenPPOLoss."""

import copy

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data.replay_buffers import SamplerWithoutReplacement

from ppo_objectives import AdaptiveKLController, KLPenaltyTransform, MaskedGAE, TokenPPOLoss

V, B, R, MB = 7, 16, 6, 4


class TokenPolicy(nn.Module):
    """log_prob [B, R] and entropy [B, R] of each token from an embedding of the token before it."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.head = nn.Linear(16, V)

    def forward(self, prev_tokens, tokens):
        logp_all = torch.log_softmax(self.head(self.emb(prev_tokens)), -1)
        logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return logp, -(logp_all.exp() * logp_all).sum(-1)


class TokenCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, prev_tokens):
        return self.head(self.emb(prev_tokens)).squeeze(-1)


def rollout(actor, critic, reference, seed=0):
    """Sample B responses of up to R tokens; score = fraction of tokens equal to 3, on the last token."""
    g = torch.Generator().manual_seed(seed)
    prev = torch.zeros(B, dtype=torch.long)
    tokens, prevs = [], []
    with torch.no_grad():
        for _ in range(R):
            logits = actor.module.head(actor.module.emb(prev))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g).squeeze(-1)
            prevs.append(prev)
            tokens.append(nxt)
            prev = nxt
    tokens, prevs = torch.stack(tokens, 1), torch.stack(prevs, 1)
    lengths = torch.randint(2, R + 1, (B,), generator=g)
    mask = torch.arange(R) < lengths[:, None]
    score = ((tokens == 3) & mask).float().sum(-1) / lengths
    td = TensorDict({"prev_tokens": prevs, "tokens": tokens, "mask": mask, ("next", "reward"): score}, [B])
    with torch.no_grad():
        td = actor(td)
        td["sample_log_prob"] = td.pop("log_prob")
        del td["entropy"]
        td = critic(td)
    # the reference runs inside the transform; the sequence score lands on each last valid token
    td = KLPenaltyTransform(reference, coeff=0.05)(td)
    td.batch_size = [B, R]
    return MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)(td)


def make_nets(seed=0):
    torch.manual_seed(seed)
    actor = TensorDictModule(TokenPolicy(), in_keys=["prev_tokens", "tokens"], out_keys=["log_prob", "entropy"])
    critic = TensorDictModule(TokenCritic(), in_keys=["prev_tokens"], out_keys=["state_value"])
    reference = copy.deepcopy(actor).requires_grad_(False)
    return actor, critic, reference


def test_replay_buffer_minibatches_train_the_loss_for_several_epochs():
    actor, critic, reference = make_nets()
    batch = rollout(actor, critic, reference)
    loss = TokenPPOLoss.minimind(actor, critic)
    optim = torch.optim.Adam(loss.parameters(), lr=3e-2)
    with torch.no_grad():
        before = loss(batch)
    # the policy that sampled is the one being optimised: ratio 1, nothing clipped, KL to it 0
    assert before["kl_approx"] == 0 and before["clip_fraction"] == 0
    assert before["loss_objective"].abs() < 1e-6  # -mean(whitened A) over the valid tokens

    rb = ReplayBuffer(storage=LazyTensorStorage(B), sampler=SamplerWithoutReplacement(), batch_size=MB)
    rb.extend(batch)
    for epoch in range(4):
        seen = []
        for _ in range(B // MB):
            minibatch, info = rb.sample(return_info=True)
            assert minibatch.batch_size == (MB, R)
            seen.append(info["index"])
            out = loss(minibatch)
            total = sum(v for k, v in out.items() if k.startswith("loss_"))
            assert torch.isfinite(total)
            optim.zero_grad()
            total.backward()
            optim.step()
        assert sorted(torch.cat(seen).tolist()) == list(range(B))  # every response once per epoch

    with torch.no_grad():
        after = loss(batch)
    assert after["loss_objective"] < before["loss_objective"] - 1e-3  # the surrogate improved
    assert after["loss_critic"] < before["loss_critic"]  # the critic fits the returns better
    assert after["kl_approx"] > 0 and after["kl_ref"] > 0  # the policy moved away from the sampler/reference
    assert 0 < after["ESS"] <= 1


def test_adaptive_kl_controller_follows_the_losses_kl_ref():
    actor, critic, reference = make_nets(seed=1)
    loss = TokenPPOLoss(actor, critic, kl_to_ref_coeff=0.1)
    ctl = AdaptiveKLController(init_coeff=0.1, target=1e-6, horizon=B)
    optim = torch.optim.SGD(loss.parameters(), lr=0.5)
    batch = rollout(actor, critic, reference, seed=1)
    for _ in range(3):
        out = loss(batch)
        optim.zero_grad()
        sum(v for k, v in out.items() if k.startswith("loss_")).backward()
        optim.step()
        loss.kl_to_ref_coeff.copy_(ctl.update(loss(batch)["kl_ref"], n_steps=B))  # schedulable buffer, no host sync
    assert float(loss.kl_to_ref_coeff) > 0.1  # KL above target: the penalty grew
    assert float(loss.kl_to_ref_coeff) == pytest.approx(float(ctl.coeff))


def test_input_batch_survives_the_whole_pipeline_unchanged():
    """The loss reads the batch it is given (not a copy) and writes nothing into it, nor into a buffer's storage."""
    actor, critic, reference = make_nets(seed=2)
    batch = rollout(actor, critic, reference, seed=2)
    snapshot = batch.clone()
    loss = TokenPPOLoss(actor, critic)
    loss(batch)
    assert set(batch.keys(True, True)) == set(snapshot.keys(True, True)) and (batch == snapshot).all()
    rb = ReplayBuffer(storage=LazyTensorStorage(B), sampler=SamplerWithoutReplacement(), batch_size=MB)
    rb.extend(batch)
    stored = rb.storage.get(slice(None)).clone()
    loss(rb.sample())
    assert (rb.storage.get(slice(None)) == stored).all() and (batch == snapshot).all()


@pytest.mark.parametrize("layout", ["response", "full"])
def test_the_pipeline_on_kit_batches_matches_the_references_and_ignores_masked_entries(layout):
    """KLPenaltyTransform -> MaskedGAE -> TokenPPOLoss on the testing kit's batches of both layouts."""
    from ppo_objectives import testing

    if layout == "response":
        batch = testing.response_batch(batch_size=6, response_len=7, mask="mixed", seed=3)
    else:
        batch = testing.full_sequence_batch(batch_size=4, seq_len=9, with_ref_log_prob=True, seed=3)
    actor, critic = testing.tiny_actor_critic(layout=layout, seed=3)
    kl = KLPenaltyTransform(coeff=0.05)
    gae = MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)
    loss = TokenPPOLoss.minimind(actor, critic)

    def pipeline(td):
        return loss(gae(kl(td)))

    # the KL-penalised rewards and the advantages equal the plain-loop references
    td = gae(kl(batch.clone()))
    shape = batch["mask"].shape
    penalty = testing.reference_kl(batch["sample_log_prob"], batch["ref_log_prob"], "k1", mask=batch["mask"])
    want_reward = batch["next", "reward"].reshape(shape).double() - 0.05 * penalty
    testing.assert_matches_reference(td["next", "reward"].reshape(shape), want_reward, name="penalised reward")
    adv, target = testing.reference_gae_tensordict(td, 1.0, 0.95, average_gae=True)
    testing.assert_matches_reference(td["advantage"], adv, name="advantage")
    testing.assert_matches_reference(td["value_target"], target, name="value_target")
    # and nothing at a masked position reaches a loss term or a diagnostic
    report = testing.assert_mask_invariant(pipeline, batch)
    assert ("loss_objective",) in report.outputs and ("loss_critic",) in report.outputs
    out = pipeline(batch.clone())
    total = sum(v for k, v in out.items() if k.startswith("loss_"))
    total.backward()
    assert all(torch.isfinite(p.grad).all() for p in loss.parameters() if p.grad is not None)
