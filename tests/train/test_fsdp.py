"""``--fsdp``: the training loop with the actor's and the critic's models sharded by FSDP2
(``fully_shard``) over 2 gloo ranks on CPU -- the sharding itself, the gathered rollout, one
update against one process on the concatenated batch (trust region included), checkpoint
entries, the torchrun job against the DDP job, ``--resume``, and the configurations it refuses."""

from __future__ import annotations

import datetime
import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _flags import SMALL
from test_loop import _pieces
from test_loop_distributed import _params, _rollout

from ppo_objectives import train as T
from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.readouts import make_actor_critic
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.train import distributed

WORLD = 2
# One AdamW step of LR from the seed-0 networks on both ranks' rows takes kl_approx to 0.024; 1/2, 1/4 and
# 1/8 of it to 0.012-0.014, 0.008-0.009 and 0.003-0.0035 (measured). So under UNDO_KL even 1/8 of the first
# step crosses (it is undone: parameters and AdamW state restored), and under BACKTRACK_KL half of it is kept.
LR = 0.03
UNDO_KL = 1e-3
BACKTRACK_KL = 0.018


def _on_policy_rollout(rank: int):
    """The networks of seed 0 (the same on every rank) and a rollout of them with rank ``rank``'s own prompts
    and samples: its rows are on-policy for the networks every rank starts from."""
    cfg, task, _, ac, kl, gae, _, _ = _pieces(seed=0)
    env = TokenLMEnv.from_task(task, num_envs=16, seed=rank)
    torch.manual_seed(rank)
    collector = T.make_collector(cfg, task, ac.policy, env)
    try:
        llm = T.rollout_batch(iter(collector), ac, kl, gae, env.prompt_len, env.max_new_tokens)
    finally:
        collector.shutdown()
    return ac, llm


def _cfg(early_stop_kl: float) -> T.TrainConfig:
    return T.TrainConfig(num_envs=16, preset="pico", ppo_epochs=3, minibatches=1, early_stop_kl=early_stop_kl)


def _optimizers(ac):
    return (torch.optim.AdamW(ac.actor_parameters(), lr=LR, weight_decay=0.0),
            torch.optim.AdamW(ac.critic_parameters(), lr=LR, weight_decay=0.0))  # fmt: skip


def _full_params(ac) -> torch.Tensor:
    """Every actor and critic parameter, gathered from the shards, in :func:`_params`' order."""
    return torch.cat([p.detach().full_tensor().flatten() for p in ac.actor_parameters() + ac.critic_parameters()])


def _local_moments(opts) -> torch.Tensor:
    return torch.cat([v.to_local().flatten() for opt in opts for s in opt.state.values() for k, v in s.items()
                      if k != "step"])  # fmt: skip


# --------------------------------------------------------------------------- #
# 2 gloo processes: shard, roll out gathered, update, checkpoint
# --------------------------------------------------------------------------- #


def _shards(ac) -> list[tuple[str, int, int, int]]:
    """(name, elements on this rank, elements in all, rows in all) of every sharded parameter."""
    return [(f"{owner}.{n}", p.to_local().numel(), p.numel(), p.shape[0])
            for owner in ("actor_model", "critic_model", "critic_head")
            for n, p in getattr(ac, owner).named_parameters()]  # fmt: skip


def _check_gathered_rollout(ac, rank, res) -> None:
    """Rank r makes 1 + 2 r forwards inside the gathered block (no collective each), then one sharded."""
    x = torch.randint(16, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with distributed.gathered_for_rollout(ac.actor_model):
            res["types_inside"] = {type(p).__name__ for p in ac.actor_model.parameters()}
            for _ in range(1 + 2 * rank):
                res["gathered_logits"] = ac.actor_model(x).logits
        res["types_after"] = {type(p).__name__ for p in ac.actor_model.parameters()}
        res["sharded_logits"] = ac.actor_model(x).logits


def _check_checkpoint_entries(ac, opts, pg, rank, res) -> None:
    """Full state dicts gathered on rank 0, then loaded back on every rank over perturbed shards."""
    stateful = dict(actor_model=ac.actor_model, critic_model=ac.critic_model, critic_head=ac.critic_head,
                    actor_opt=opts[0], critic_opt=opts[1])  # fmt: skip
    entries = distributed.fsdp_stateful(stateful, ac)
    state = {name: entry.state_dict() for name, entry in entries.items()}
    res["state"] = state if rank == 0 else None
    res["state_empty_off_rank_0"] = all(not v for v in state.values())
    before_params, before_moments = _full_params(ac), _local_moments(opts)
    shared = [state if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0, group=pg)
    with torch.no_grad():
        for p in ac.actor_parameters() + ac.critic_parameters():
            p.to_local().add_(1.0)
    for opt in opts:
        for s in opt.state.values():
            s["exp_avg"].to_local().zero_()
    for name, entry in entries.items():
        entry.load_state_dict(shared[0][name])
    res["reloaded_params"] = torch.equal(_full_params(ac), before_params)
    res["reloaded_moments"] = torch.equal(_local_moments(opts), before_moments)


def _nan_on_rank_1(loss, rank):
    forward = loss.forward

    def poisoned(tensordict, **kw):
        out = forward(tensordict, **kw)
        if rank == 1:
            out.set("loss_objective", out["loss_objective"] * float("nan"))
        return out

    return poisoned


def _check_hf_llama(rank, d, res) -> None:
    """A tiny Hugging Face Llama: its decoder layers are found and sharded; the loss gradient gathered from
    the shards is the unsharded model's (both ranks feed the same rows, so the average is that gradient)."""
    from transformers import LlamaConfig

    from ppo_objectives.llm.hf import HFCausalLMAdapter

    torch.manual_seed(0)
    lm = HFCausalLMAdapter.from_config(LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16))  # fmt: skip
    ac = make_actor_critic(lm, 3)
    x = torch.randint(16, (3, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(x, dtype=torch.bool)

    def loss_of(module):
        logp, _ = module(x, mask)
        return logp.square().sum()

    loss_of(ac.actor.module).backward()
    expected = [p.grad.clone() for p in ac.actor_parameters()]
    res["hf_blocks"] = [type(b).__name__ for b in distributed.transformer_blocks(lm)]
    distributed.shard_fsdp(ac, d, torch.device("cpu"))
    loss_of(ac.actor.module).backward()
    got = [p.grad.full_tensor() for p in ac.actor_parameters()]
    res["hf_grad_err"] = max(float((a - b).abs().max()) for a, b in zip(got, expected))
    res["hf_local_fraction"] = sum(p.to_local().numel() for p in ac.actor_parameters()) / sum(
        p.numel() for p in ac.actor_parameters())


def _fsdp_worker(rank, init_file, results_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))  # a hang fails, it does not wait forever
    try:
        pg, res = dist.group.WORLD, {}
        d = distributed.Dist(rank, WORLD, rank, pg)
        ac, llm = _on_policy_rollout(rank)  # identical networks (seed 0), each rank's own rows
        res["llm"] = llm.clone()
        x = torch.randint(16, (2, 6), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            res["unsharded_logits"] = ac.actor_model(x).logits
        actor, critic, wrappers = distributed.shard_fsdp(ac, d, torch.device("cpu"))
        res["wrappers"], res["shards"] = len(wrappers), _shards(ac)
        _check_gathered_rollout(ac, rank, res)
        # the trust region on the shards: every step undone, then steps shortened (the same steps on both ranks)
        opts, loss = _optimizers(ac), TokenPPOLoss(actor, critic, kl_to_ref_coeff=0.0, entropy_bonus=True, functional=False)
        res["undo_stats"] = T.ppo_update(llm, loss, ac, opts, _cfg(UNDO_KL), torch.Generator(), process_group=pg)
        res["undo_params"] = _full_params(ac)
        res["stats"] = T.ppo_update(llm, loss, ac, opts, _cfg(BACKTRACK_KL), torch.Generator(), process_group=pg)
        res["params"] = _full_params(ac)
        res["steps"] = sorted({int(s["step"]) for opt in opts for s in opt.state.values()})
        distributed.check_ranks_in_sync([ac.actor_model, ac.critic_model, ac.critic_head], pg)
        _check_checkpoint_entries(ac, opts, pg, rank, res)
        # a NaN loss on rank 1 alone: both ranks skip the step, no collective left waiting
        before, loss.forward = _full_params(ac), _nan_on_rank_1(loss, rank)
        res["nan_stats"] = T.ppo_update(llm, loss, ac, opts, _cfg(0.0), torch.Generator(), process_group=pg)
        res["nan_params_unchanged"] = torch.equal(_full_params(ac), before)
        _check_hf_llama(rank, d, res)
        torch.save(res, os.path.join(results_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_fsdp_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=WORLD, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


@pytest.mark.slow  # two spawned ranks (the module's fsdp_ranks: about 10 s)
def test_every_parameter_is_split_between_the_ranks(fsdp_ranks):
    a, b = (res["shards"] for res in fsdp_ranks)
    assert [s[0] for s in a] == [s[0] for s in b] and len(a) > 10
    assert {s[0].split(".")[0] for s in a} == {"actor_model", "critic_model", "critic_head"}
    for (name, here, total, rows), (_, there, _, _) in zip(a, b):
        assert here + there == total, name  # each element lives on exactly one rank
        per_row = total // rows
        assert here == min(-(-rows // WORLD), rows) * per_row, name  # rank 0: ceil(rows / 2) rows (dim 0)
    total = sum(s[2] for s in a)
    assert 0.49 < sum(s[1] for s in a) / total < 0.51 and 0.49 < sum(s[1] for s in b) / total < 0.51
    assert fsdp_ranks[0]["wrappers"] == 0  # nothing to free: the modules themselves are sharded


@pytest.mark.slow  # two spawned ranks (the module's fsdp_ranks: about 10 s)
def test_rollout_runs_on_the_gathered_actor_with_any_number_of_forwards_per_rank(fsdp_ranks):
    for res in fsdp_ranks:  # rank 0 made 1 forward, rank 1 made 3: no collective per forward, no hang
        assert res["types_inside"] == {"Parameter"} and res["types_after"] == {"DTensor"}
        torch.testing.assert_close(res["gathered_logits"], res["unsharded_logits"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(res["sharded_logits"], res["unsharded_logits"], atol=1e-6, rtol=1e-5)


@pytest.mark.slow  # two spawned ranks (the module's fsdp_ranks: about 10 s)
def test_fsdp_update_on_two_ranks_equals_one_process_on_the_concatenated_batch(fsdp_ranks):
    assert torch.equal(fsdp_ranks[0]["params"], fsdp_ranks[1]["params"])  # gathered: one model
    ac = _pieces(seed=0)[3]  # one process, the same networks, both ranks' rows
    loss = TokenPPOLoss(ac.actor, ac.critic, kl_to_ref_coeff=0.0, entropy_bonus=True, functional=False)
    opts = _optimizers(ac)
    both = torch.cat([fsdp_ranks[0]["llm"], fsdp_ranks[1]["llm"]])
    initial = _params(ac)
    undo = T.ppo_update(both, loss, ac, opts, _cfg(UNDO_KL), torch.Generator())
    assert torch.equal(_params(ac), initial)  # the crossing step was undone here ...
    assert torch.equal(fsdp_ranks[0]["undo_params"], initial)  # ... and on the shards, bit for bit
    stats = T.ppo_update(both, loss, ac, opts, _cfg(BACKTRACK_KL), torch.Generator())
    assert not torch.allclose(initial, _params(ac), atol=1e-4)  # the kept steps really moved them
    torch.testing.assert_close(fsdp_ranks[0]["params"], _params(ac), atol=1e-6, rtol=1e-5)
    for key in ("updates", "early_stopped", "rolled_back", "step_fraction"):
        assert fsdp_ranks[0]["undo_stats"][key] == undo[key], key
        assert fsdp_ranks[0]["stats"][key] == fsdp_ranks[1]["stats"][key] == stats[key], key
    assert undo["step_fraction"] == 0.0 and undo["updates"] == 0
    assert stats["rolled_back"] == 1 and stats["step_fraction"] == 0.5 and stats["updates"] == 1
    for key in ("loss_objective", "loss_critic", "grad_norm", "kl_approx_max"):
        assert fsdp_ranks[0]["stats"][key] == pytest.approx(stats[key], rel=1e-4, abs=1e-6), key
    # the AdamW step count of every shard: the steps kept, the same on both ranks
    assert fsdp_ranks[0]["steps"] == fsdp_ranks[1]["steps"] == [stats["updates"]]


@pytest.mark.slow  # two spawned ranks (the module's fsdp_ranks: about 10 s)
def test_checkpoint_entries_gather_full_state_on_rank_0_and_load_back_on_every_rank(fsdp_ranks):
    state = fsdp_ranks[0]["state"]
    ac = _pieces(seed=0)[3]
    for name in ("actor_model", "critic_model", "critic_head"):  # the keys and shapes of an unsharded run
        plain = getattr(ac, name).state_dict()
        assert sorted(state[name]) == sorted(plain), name
        assert all(state[name][k].shape == plain[k].shape and not hasattr(state[name][k], "to_local")
                   for k in plain), name  # fmt: skip
    full = torch.cat([state["actor_model"][k].flatten() for k, _ in ac.actor_model.named_parameters()])
    assert torch.equal(full, fsdp_ranks[0]["params"][: full.numel()])
    critic_keys = set(state["critic_opt"]["state"])  # keyed by name: the critic's trunk and its head
    assert {k.split(".")[0] for k in critic_keys} == {"model", "value_head"}
    assert set(state["actor_opt"]["state"]) == {k for k, _ in ac.actor_model.named_parameters()}
    for res in fsdp_ranks:
        assert res["reloaded_params"] and res["reloaded_moments"]
    assert fsdp_ranks[1]["state_empty_off_rank_0"] and not fsdp_ranks[0]["state_empty_off_rank_0"]


@pytest.mark.slow  # two spawned ranks (the module's fsdp_ranks: about 10 s)
def test_non_finite_loss_on_one_rank_skips_the_step_on_every_rank_under_fsdp(fsdp_ranks):
    for res in fsdp_ranks:
        assert res["nan_stats"]["skipped_steps"] == 3 and res["nan_stats"]["updates"] == 0
        assert res["nan_params_unchanged"]


@pytest.mark.slow  # two spawned ranks (the module's fsdp_ranks: about 10 s)
def test_hugging_face_llama_decoder_layers_are_sharded_with_the_unsharded_gradient(fsdp_ranks):
    for res in fsdp_ranks:
        assert res["hf_blocks"] == ["LlamaDecoderLayer", "LlamaDecoderLayer"]
        assert res["hf_grad_err"] < 1e-5
        assert 0.4 < res["hf_local_fraction"] < 0.6


# --------------------------------------------------------------------------- #
# torchrun end to end
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def torchrun_fsdp(torchrun, torchrun_jobs, tmp_path_factory):
    """--fsdp: 1 iteration, then --resume to 2; the DDP job of the same flags, 2 iterations in one go (the
    session's ``torchrun_jobs["two"]``)."""
    fsdp = tmp_path_factory.mktemp("torchrun_fsdp") / "fsdp"
    first, _ = torchrun(fsdp, 1, "--fsdp", "--no-plot")
    fsdp_rows = T.read_metrics(fsdp / "metrics.csv")
    resumed, _ = torchrun(fsdp, 2, "--fsdp", "--no-plot", "--resume")
    return fsdp, torchrun_jobs["two"][0], fsdp_rows, (first, resumed)


@pytest.mark.slow
def test_torchrun_fsdp_job_runs_end_to_end_and_checks_its_ranks(torchrun_fsdp):
    fsdp, _, first_rows, procs = torchrun_fsdp
    for proc in procs:
        assert "parameters identical on all 2 ranks" in proc.stderr and proc.stdout.count("reward (mean of") == 1
    assert [r["iteration"] for r in first_rows] == [1.0] and first_rows[0]["updates"] == 16.0
    assert first_rows[0]["episodes"] >= 32  # 16 rows on each of the 2 ranks


@pytest.mark.slow
def test_torchrun_fsdp_job_resumed_trains_to_the_metrics_and_parameters_of_the_ddp_job(torchrun_fsdp):
    fsdp, ddp, first_rows, _ = torchrun_fsdp
    a, b = T.read_metrics(fsdp / "metrics.csv"), T.read_metrics(ddp / "metrics.csv")
    assert [r["iteration"] for r in a] == [1.0, 2.0] and [r["updates"] for r in a] == [16.0, 16.0]
    assert a[0] == first_rows[0]  # the resumed job appended iteration 2
    # iteration 2 after the resume needs the full model and AdamW state back on both ranks' shards, and
    # both ranks' RNG states; FSDP's sharded AdamW gives DDP's update to float32 rounding
    for key in ("reward", "episodes", "loss_objective", "loss_critic", "kl_ref", "kl_approx", "grad_norm"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-4, abs=1e-6), key
    fsdp_ckpt, ddp_ckpt = (torch.load(o / "checkpoint.pt", weights_only=False) for o in (fsdp, ddp))
    assert fsdp_ckpt["iteration"] == 2 and fsdp_ckpt["config"]["fsdp"] and fsdp_ckpt["actor_opt"]["state"]
    for name in ("actor_model", "critic_model", "critic_head"):  # 32 AdamW steps on shards vs on whole tensors
        assert sorted(fsdp_ckpt[name]) == sorted(ddp_ckpt[name]), name
        for k, v in ddp_ckpt[name].items():
            torch.testing.assert_close(fsdp_ckpt[name][k], v, atol=1e-5, rtol=1e-4, msg=f"{name}.{k}")
    for k, v in ddp_ckpt["reference"].items():  # copied before sharding: the warm-started model, bit for bit
        assert torch.equal(fsdp_ckpt["reference"][k], v), k


# --------------------------------------------------------------------------- #
# What --fsdp refuses
# --------------------------------------------------------------------------- #


def test_fsdp_without_torchrun_is_a_clear_error(tmp_path, monkeypatch, cli_error):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = cli_error(["--iterations", "1", "--out", str(tmp_path), "--fsdp", *SMALL])
    assert re.search("--fsdp shards the models over the ranks of a torchrun job.*drop --fsdp", err, re.S)


def test_fsdp_with_a_shared_trunk_is_a_clear_error(tmp_path, monkeypatch, cli_error):
    for k, v in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    err = cli_error(["--iterations", "1", "--out", str(tmp_path), "--fsdp", "--shared-trunk", *SMALL])
    assert re.search("--fsdp --shared-trunk: .*shard it once for each.*drop --shared-trunk", err, re.S)


def test_fsdp_with_collector_workers_is_a_clear_error(tmp_path, cli_error):
    err = cli_error(["--iterations", "1", "--out", str(tmp_path), "--fsdp", "--workers", "2", *SMALL])
    assert re.search("--fsdp --workers 2: .*use --workers 1 with --fsdp", err, re.S)


def test_shard_fsdp_without_a_process_group_is_a_clear_error():
    ac = _pieces(seed=0)[3]
    with pytest.raises(ValueError, match="shard_fsdp needs a torchrun process group.*torchrun --nproc_per_node"):
        distributed.shard_fsdp(ac, distributed.Dist(), torch.device("cpu"))


def test_resuming_a_checkpoint_without_fsdp_under_fsdp_is_a_clear_error():
    cfg, ac, loss, opts, llm = _rollout(ppo_epochs=1, minibatches=1, early_stop_kl=0.0)
    T.ppo_update(llm, loss, ac, opts, cfg, torch.Generator().manual_seed(0))
    entry = distributed.fsdp_stateful(dict(actor_opt=opts[0]), ac)["actor_opt"]
    with pytest.raises(ValueError, match="keyed by parameter index, as a run without --fsdp writes it.*resume with the flags"):
        entry.load_state_dict(opts[0].state_dict())  # what a DDP / one-process checkpoint holds
