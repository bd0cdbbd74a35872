"""The training loop at scale and under faults: torchrun data parallelism, the non-finite guard,
a crash while saving a checkpoint, and the loss's global normaliser."""

from __future__ import annotations

import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _flags import SMALL
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from test_loop import _params, _rollout

from ppo_objectives import train as T
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.train import distributed

WORLD = 2


# --------------------------------------------------------------------------- #
# TokenPPOLoss(normalizer=...)
# --------------------------------------------------------------------------- #


class _Const(torch.nn.Module):
    """``value + w`` (w = 0) per token, and optionally an entropy of 1 per token."""

    def __init__(self, value, with_entropy=False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.value, self.with_entropy = value, with_entropy

    def forward(self, tokens):
        out = torch.full(tokens.shape, self.value) + self.w
        return (out, torch.ones(tokens.shape)) if self.with_entropy else out


def test_loss_normalizer_replaces_the_local_token_count_of_every_loss_term():
    logp = torch.tensor(0.5).log().item()
    actor = TensorDictModule(_Const(logp, with_entropy=True), in_keys=["tokens"], out_keys=["log_prob", "entropy"])
    critic = TensorDictModule(_Const(0.0), in_keys=["tokens"], out_keys=["state_value"])
    td = TensorDict(
        tokens=torch.zeros(1, 3, dtype=torch.long),
        mask=torch.tensor([[True, True, False]]),
        sample_log_prob=torch.full((1, 3), logp),
        ref_log_prob=torch.full((1, 3), logp - 1.0),  # d = ref - logp = -1: k3 = e^-1 - (-1) - 1 = e^-1
        advantage=torch.tensor([[1.0, 3.0, 99.0]]),
        value_target=torch.tensor([[2.0, 2.0, 99.0]]),
        state_value=torch.zeros(1, 3),
        batch_size=[1, 3],
    )
    loss = TokenPPOLoss(actor, critic, clip_value=None, kl_to_ref_coeff=1.0, entropy_coeff=1.0)
    local, glob = loss(td).detach(), loss(td, normalizer=torch.tensor(4.0)).detach()
    # ratio 1: objective -(1 + 3) / 2 tokens = -2 locally, -(1 + 3) / 4 = -1 with 4 global tokens
    assert float(local["loss_objective"]) == pytest.approx(-2.0)
    assert float(glob["loss_objective"]) == pytest.approx(-1.0)
    # critic 0.5 * (0.5 * 4 + 0.5 * 4) / n = 1; KL (e^-1 + e^-1) / n = e^-1; entropy -(1 + 1) / n = -1
    # with the local n = 2; all halve with n = 4
    for key, value in (("loss_critic", 1.0), ("loss_kl_ref", 0.36787944), ("loss_entropy", -1.0)):
        assert float(local[key]) == pytest.approx(value, rel=1e-5), key
        assert float(glob[key]) == pytest.approx(value / 2, rel=1e-5), key
    # diagnostics stay local means over this minibatch's tokens
    assert float(glob["kl_approx"]) == float(local["kl_approx"]) == 0.0


# --------------------------------------------------------------------------- #
# Non-finite guard
# --------------------------------------------------------------------------- #


class _NaNOnCall:
    """Wraps TokenPPOLoss.forward: call number ``which`` (from 1) returns a NaN objective."""

    def __init__(self, monkeypatch, which):
        self.calls, self.which, self.original = 0, which, TokenPPOLoss.forward
        monkeypatch.setattr(TokenPPOLoss, "forward", self)

    def __get__(self, obj, cls=None):
        return lambda *a, **kw: self(obj, *a, **kw)

    def __call__(self, module, tensordict, **kw):
        out = self.original(module, tensordict, **kw)
        self.calls += 1
        if self.calls == self.which:
            out.set("loss_objective", out["loss_objective"] * float("nan"))
        return out


def test_non_finite_loss_skips_the_step_and_leaves_parameters_and_optimizer_untouched(monkeypatch, capsys):
    cfg, ac, loss, opts, llm = _rollout(ppo_epochs=1, minibatches=1, early_stop_kl=0.0)
    before = _params(ac)
    _NaNOnCall(monkeypatch, which=1)
    stats = T.ppo_update(llm, loss, ac, opts, cfg, torch.Generator().manual_seed(0))
    assert stats["skipped_steps"] == 1 and stats["updates"] == 0
    assert torch.equal(_params(ac), before)  # bit for bit
    assert all(not opt.state for opt in opts)  # AdamW never stepped: no moments, no step count
    assert "non-finite loss" in capsys.readouterr().err


def test_non_finite_gradient_norm_skips_the_step_and_clears_the_gradients(capsys):
    cfg, ac, loss, opts, llm = _rollout(ppo_epochs=2, minibatches=1, early_stop_kl=0.0)
    p = ac.actor_parameters()[0]
    calls = []

    def poison_first(grad):  # the first backward gets an inf gradient, the second a clean one
        calls.append(1)
        return grad * float("inf") if len(calls) == 1 else grad

    p.register_hook(poison_first)
    before = _params(ac)
    stats = T.ppo_update(llm, loss, ac, opts, cfg, torch.Generator().manual_seed(0))
    assert stats["skipped_steps"] == 1 and stats["updates"] == 1
    assert torch.isfinite(_params(ac)).all() and not torch.equal(_params(ac), before)
    assert {int(s["step"]) for opt in opts for s in opt.state.values()} == {1}  # one real step
    assert "non-finite gradient norm" in capsys.readouterr().err


def test_main_job_counts_a_skipped_step_in_the_metrics(tmp_path, monkeypatch):
    _NaNOnCall(monkeypatch, which=2)  # iteration 1, second minibatch
    T.main(["--iterations", "2", "--out", str(tmp_path), "--no-plot", "--early-stop-kl", "0", *SMALL])
    rows = T.read_metrics(tmp_path / "metrics.csv")
    assert [r["skipped_steps"] for r in rows] == [1.0, 0.0]
    assert [r["updates"] for r in rows] == [15.0, 16.0]  # 4 epochs x 4 minibatches, one skipped
    assert all(torch.isfinite(torch.tensor([r["loss_objective"], r["grad_norm"]])).all() for r in rows)


# --------------------------------------------------------------------------- #
# Checkpoints: a crash while saving
# --------------------------------------------------------------------------- #


def test_crash_while_saving_leaves_the_previous_checkpoint_and_resume_still_continues_exactly(tmp_path, monkeypatch):
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    args = ["--no-plot", "--save-every", "2", *SMALL]
    T.main(["--iterations", "4", "--out", str(full), *args])
    T.main(["--iterations", "2", "--out", str(crashed), *args])
    good = (crashed / "checkpoint.pt").read_bytes()

    real_save = torch.save

    def dying_save(obj, f, *a, **kw):  # the disk fills up half way through the file
        with open(f, "wb") as fh:
            fh.write(b"PK\x03\x04 truncated")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="No space left"):
        T.main(["--iterations", "4", "--out", str(crashed), "--resume", *args])
    monkeypatch.setattr(torch, "save", real_save)
    assert (crashed / "checkpoint.pt").read_bytes() == good  # the latest checkpoint is untouched
    ckpt = torch.load(crashed / "checkpoint.pt", weights_only=False)
    assert ckpt["iteration"] == 2
    expected = {"actor_model", "critic_model", "critic_head", "reference", "actor_opt", "critic_opt",
                "kl_controller", "torch_rng", "update_rng", "env_rng", "rank_rng", "iteration", "world_size"}  # fmt: skip
    assert expected <= set(ckpt)
    assert len(ckpt["rank_rng"]) == 1 and ckpt["actor_opt"]["state"]  # optimizer moments saved

    T.main(["--iterations", "4", "--out", str(crashed), "--resume", *args])
    a, b = T.read_metrics(full / "metrics.csv"), T.read_metrics(crashed / "metrics.csv")
    # the rows the crashed run logged after its last checkpoint were dropped and logged again
    assert [r["iteration"] for r in b] == [1.0, 2.0, 3.0, 4.0]
    for key in ("reward", "loss_objective", "loss_critic", "kl_ref", "kl_approx", "grad_norm"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-5, abs=1e-7), key


def test_resume_with_another_number_of_processes_is_a_clear_error(tmp_path):
    T.main(["--iterations", "1", "--out", str(tmp_path), "--no-plot", *SMALL])
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    ckpt["world_size"] = 2
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match="written by a run with 2 process.*same torchrun --nproc_per_node"):
        T.main(["--iterations", "2", "--out", str(tmp_path), "--no-plot", "--resume", *SMALL])


# --------------------------------------------------------------------------- #
# Launcher detection
# --------------------------------------------------------------------------- #


def test_world_size_without_the_rest_of_torchrun_env_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 is set but \['RANK'.*start data-parallel runs with torchrun"):
        T.main(["--iterations", "1", "--out", str(tmp_path), *SMALL])


def test_shared_trunk_under_torchrun_is_a_clear_error(tmp_path, monkeypatch, cli_error):
    for k, v in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    err = cli_error(["--iterations", "1", "--out", str(tmp_path), "--shared-trunk", *SMALL])
    assert re.search("--shared-trunk under torchrun.*add --no-shared-trunk for data-parallel runs", err, re.S)


# --------------------------------------------------------------------------- #
# 2 gloo processes: one DDP update == one process on the concatenated batch
# --------------------------------------------------------------------------- #


def _ddp_worker(rank, init_file, results_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        pg = dist.group.WORLD
        res = {}
        # each rank rolls out its own batch (different seeds); identical networks (seed 0)
        cfg, ac, _, _, llm = _rollout(seed=rank, ppo_epochs=1, minibatches=1, early_stop_kl=0.0)
        torch.manual_seed(0)
        cfg, ac, loss, opts, _ = _rollout(seed=0, ppo_epochs=1, minibatches=1, early_stop_kl=0.0)
        res["llm"] = llm.clone()
        actor, critic, wrappers = distributed.wrap_ddp(ac, distributed.Dist(rank, WORLD, rank, pg), torch.device("cpu"))
        ddp_loss = TokenPPOLoss(actor, critic, kl_to_ref_coeff=0.0, entropy_bonus=True, functional=False)
        stats = T.ppo_update(llm, ddp_loss, ac, opts, cfg, torch.Generator().manual_seed(0), process_group=pg)
        res["params"], res["stats"] = _params(ac), stats
        distributed.check_ranks_in_sync([ac.actor_model, ac.critic_model, ac.critic_head], pg)
        # a NaN loss on rank 1 alone: both ranks skip the step (no collective left waiting)
        before, forward = _params(ac), ddp_loss.forward

        def nan_on_rank_1(tensordict, **kw):
            out = forward(tensordict, **kw)
            if rank == 1:
                out.set("loss_objective", out["loss_objective"] * float("nan"))
            return out

        ddp_loss.forward = nan_on_rank_1
        res["nan_stats"] = T.ppo_update(llm, ddp_loss, ac, opts, cfg, torch.Generator(), process_group=pg)
        res["nan_params_unchanged"] = torch.equal(_params(ac), before)
        # rank 1 holds 2 rows for 4 minibatches (two of its minibatches are empty): no hang, same steps
        ddp_loss.forward = forward
        few = llm if rank == 0 else llm[:2]
        cfg4 = T.TrainConfig(num_envs=16, preset="pico", ppo_epochs=1, minibatches=4, early_stop_kl=0.0)
        res["few_stats"] = T.ppo_update(few, ddp_loss, ac, opts, cfg4, torch.Generator(), process_group=pg)
        res["few_params"] = _params(ac)
        # a rank whose parameters drifted is caught
        with torch.no_grad():
            ac.critic_head.weight.add_(1e-6 * rank)
        try:
            distributed.check_ranks_in_sync([ac.actor_model, ac.critic_model, ac.critic_head], pg)
        except RuntimeError as err:
            res["drift_error"] = str(err)
        torch.save(res, os.path.join(results_dir, f"rank{rank}.pt"))
        del ddp_loss, actor, critic
        wrappers.clear()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_update():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_ddp_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=WORLD, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def test_ddp_update_on_two_ranks_equals_one_process_on_the_concatenated_batch(ddp_update):
    assert torch.equal(ddp_update[0]["params"], ddp_update[1]["params"])
    # one process, the same networks, both ranks' rows (advantages as each rank computed them)
    cfg, ac, loss, opts, _ = _rollout(seed=0, ppo_epochs=1, minibatches=1, early_stop_kl=0.0)
    both = torch.cat([ddp_update[0]["llm"], ddp_update[1]["llm"]])
    initial = _params(ac)
    assert not torch.allclose(initial, ddp_update[0]["params"], atol=1e-4)  # the step really moved them
    stats = T.ppo_update(both, loss, ac, opts, cfg, torch.Generator().manual_seed(0))
    torch.testing.assert_close(ddp_update[0]["params"], _params(ac), atol=1e-6, rtol=1e-5)
    for key in ("loss_objective", "loss_critic", "grad_norm", "kl_approx_max"):
        assert ddp_update[0]["stats"][key] == pytest.approx(stats[key], rel=1e-4, abs=1e-6), key


def test_non_finite_loss_on_one_rank_skips_the_step_on_every_rank(ddp_update):
    for res in ddp_update:
        assert res["nan_stats"]["skipped_steps"] == 1 and res["nan_stats"]["updates"] == 0
        assert res["nan_params_unchanged"]


def test_a_rank_with_fewer_rows_than_minibatches_takes_the_same_steps(ddp_update):
    assert ddp_update[0]["few_stats"]["updates"] == ddp_update[1]["few_stats"]["updates"] == 4
    assert torch.equal(ddp_update[0]["few_params"], ddp_update[1]["few_params"])


def test_parameter_drift_between_ranks_is_detected(ddp_update):
    for res in ddp_update:
        assert "the parameters differ between the 2 ranks" in res["drift_error"]
        assert "never their .module" in res["drift_error"]


# --------------------------------------------------------------------------- #
# torchrun end to end
# --------------------------------------------------------------------------- #


@pytest.mark.slow
def test_torchrun_two_processes_trains_in_sync_writes_once_and_exits(torchrun_jobs):
    out, proc, wall = torchrun_jobs["full"]
    assert wall < 60, f"torchrun took {wall:.0f}s"
    assert "parameters identical on all 2 ranks" in proc.stderr  # checked exactly by the job itself
    assert "find_unused_parameters" not in proc.stderr  # a tied TinyCausalLM critic: DDP searches for nothing
    assert proc.stdout.count("reward (mean of") == 1  # rank 0 alone reports
    rows = T.read_metrics(out / "metrics.csv")
    assert [r["iteration"] for r in rows] == [1.0, 2.0, 3.0]  # written once, not once per rank
    assert rows[0]["episodes"] >= 32  # 16 rows on each of the 2 ranks
    assert [r["updates"] for r in rows] == [16.0, 16.0, 16.0]  # both ranks took every step together
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["iteration"] == 3 and ckpt["world_size"] == 2 and len(ckpt["rank_rng"]) == 2
    # each rank sampled its own responses: different RNG streams
    assert not torch.equal(ckpt["rank_rng"][0]["torch_rng"], ckpt["rank_rng"][1]["torch_rng"])
    assert not torch.equal(ckpt["rank_rng"][0]["env_rng"], ckpt["rank_rng"][1]["env_rng"])
    assert (out / "training.png").stat().st_size > 0 and not list(out.glob("*.tmp*"))


@pytest.mark.slow
def test_torchrun_resume_continues_exactly_on_every_rank(torchrun_jobs):
    full, split = torchrun_jobs["full"][0], torchrun_jobs["split"][0]
    a, b = T.read_metrics(full / "metrics.csv"), T.read_metrics(split / "metrics.csv")
    assert [r["iteration"] for r in b] == [1.0, 2.0, 3.0]
    # iteration 3 after the resume needs both ranks' RNG states back (rank 1's rollout is in the numbers)
    for key in ("reward", "episodes", "loss_objective", "loss_critic", "kl_ref", "kl_approx", "grad_norm"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-5, abs=1e-7), key
