"""The end-to-end loop: collectors, one PPO update, early stop, checkpoints and the CLI."""

import math
import subprocess
import sys

import pytest
import torch
from _flags import SMALL

from ppo_objectives import train as T
from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.models import TinyLMConfig
from ppo_objectives.llm.readouts import frozen_reference, make_actor_critic
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.train.digit import DigitTask
from ppo_objectives.transforms import FixedKLController, KLPenaltyTransform
from ppo_objectives.value.gae import MaskedGAE


def _pieces(seed=0, num_envs=16, shared_trunk=False, **cfg_kw):
    torch.manual_seed(seed)
    cfg = T.TrainConfig(num_envs=num_envs, preset="pico", shared_trunk=shared_trunk, **cfg_kw)
    task = DigitTask("reverse", 3)
    env = TokenLMEnv.from_task(task, num_envs=num_envs, seed=seed)
    ac = make_actor_critic(TinyLMConfig.preset("pico", vocab_size=16, block_size=env.seq_len), env.prompt_len,
                           shared_trunk=shared_trunk)
    ref = frozen_reference(ac.actor_model, env.prompt_len)
    kl = KLPenaltyTransform(ref, coeff=FixedKLController(0.02))
    gae = MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)
    loss = TokenPPOLoss(ac.actor, ac.critic, kl_to_ref_coeff=0.0, entropy_bonus=True, functional=False)
    loss.make_value_estimator(gae)
    opts = (
        torch.optim.AdamW(ac.actor_parameters(), lr=3e-3),
        torch.optim.AdamW(ac.critic_parameters(), lr=3e-3),
    )
    return cfg, task, env, ac, kl, gae, loss, opts


def _total(loss, batch):
    with torch.no_grad():
        out = loss(batch)
    return float(sum(v for k, v in out.items() if k.startswith("loss_")))


def test_collector_batch_becomes_an_llm_batch_with_advantages():
    cfg, task, env, ac, kl, gae, loss, opts = _pieces()
    collector = T.make_collector(cfg, task, ac.policy, env)
    try:
        llm = T.rollout_batch(iter(collector), ac, kl, gae, env.prompt_len, env.max_new_tokens)
    finally:
        collector.shutdown()
    B, R = llm.batch_size[0], env.max_new_tokens
    assert B >= 16  # reset_at_each_iter: every row finishes its first response
    for key in ("advantage", "value_target", "state_value", "ref_log_prob", "kl_penalty", "sample_log_prob"):
        assert llm[key].shape == (B, R), key
    m = llm["mask"]
    assert (llm["advantage"][~m] == 0).all()
    # whitened over the valid tokens of the batch
    assert abs(float(llm["advantage"][m].mean())) < 1e-5
    # the reference is the starting policy: the rollout's KL to it is exactly 0
    torch.testing.assert_close(llm["kl_penalty"], torch.zeros(B, R), atol=1e-5, rtol=0)


def test_one_training_iteration_decreases_the_loss_on_a_fixed_batch():
    cfg, task, env, ac, kl, gae, loss, opts = _pieces(ppo_epochs=4, minibatches=1, early_stop_kl=0.0)
    collector = T.make_collector(cfg, task, ac.policy, env)
    try:
        llm = T.rollout_batch(iter(collector), ac, kl, gae, env.prompt_len, env.max_new_tokens)
    finally:
        collector.shutdown()
    before = _total(loss, llm)
    stats = T.ppo_update(llm, loss, ac, opts, cfg, torch.Generator().manual_seed(0))
    after = _total(loss, llm)
    assert stats["updates"] == 4 and stats["early_stopped"] == 0
    assert after < before


def _rollout(**cfg_kw):
    """Pieces of a tiny run and one rollout batch (advantages included); ``cfg_kw`` as ``_pieces`` takes them."""
    cfg, task, env, ac, kl, gae, loss, opts = _pieces(**cfg_kw)
    collector = T.make_collector(cfg, task, ac.policy, env)
    try:
        llm = T.rollout_batch(iter(collector), ac, kl, gae, env.prompt_len, env.max_new_tokens)
    finally:
        collector.shutdown()
    return cfg, ac, loss, opts, llm


def _params(ac):
    return torch.cat([p.detach().flatten().clone() for p in ac.actor_parameters() + ac.critic_parameters()])


def test_approx_kl_early_stop_really_stops_the_optimizer_steps_and_undoes_the_crossing_step():
    # the first minibatch is on-policy (kl_approx = 0, step taken); after that step the policy
    # moved, so the next minibatch's kl_approx exceeds the tiny threshold: stop, and take the
    # first step back -- parameters and AdamW state as before the update
    cfg, ac, loss, opts, llm = _rollout(ppo_epochs=4, minibatches=4, early_stop_kl=1e-12)
    before = _params(ac)
    stats = T.ppo_update(llm, loss, ac, opts, cfg, torch.Generator().manual_seed(0))
    assert stats["updates"] == 0 and stats["early_stopped"] == 1 and stats["rolled_back"] == 1
    assert stats["step_fraction"] == 0.0  # even 1/8 of the step is past a limit of 1e-12: undone
    assert torch.equal(_params(ac), before)
    assert all(not opt.state for opt in opts)  # the undone step was AdamW's first: no state left
    assert stats["kl_approx_max"] > 1e-12 and stats["kl_token_max"] >= stats["kl_approx_max"]


def test_without_rollback_the_crossing_step_is_kept_as_minimind_does():
    cfg, ac, loss, opts, llm = _rollout(ppo_epochs=4, minibatches=4, early_stop_kl=1e-12, rollback=False)
    before = _params(ac)
    stats = T.ppo_update(llm, loss, ac, opts, cfg, torch.Generator().manual_seed(0))
    assert stats["updates"] == 1 and stats["early_stopped"] == 1 and stats["rolled_back"] == 0
    steps = [int(s["step"]) for opt in opts for s in opt.state.values()]
    assert steps and set(steps) == {1}  # AdamW really stepped once, not 16 times
    assert not torch.equal(_params(ac), before)


def test_the_last_step_of_the_update_is_checked_by_one_more_forward():
    # one epoch of one minibatch: no later minibatch measures the step, the final check does
    cfg, ac, loss, opts, llm = _rollout(ppo_epochs=1, minibatches=1, early_stop_kl=1e-12)
    before = _params(ac)
    stats = T.ppo_update(llm, loss, ac, opts, cfg, torch.Generator().manual_seed(0))
    assert (stats["updates"], stats["rolled_back"], stats["early_stopped"]) == (0, 1, 1)
    assert torch.equal(_params(ac), before)


def test_rollback_keeps_the_kl_of_the_kept_policy_under_the_limit_where_minimind_overshoots():
    # a reproducer of the overshoot: lr 0.05 makes single AdamW steps far larger than the trust region
    limit = 0.05
    results = {}
    for rollback in (True, False):
        cfg, ac, loss, opts, llm = _rollout(ppo_epochs=4, minibatches=1, early_stop_kl=limit, rollback=rollback)
        for opt in opts:
            for g in opt.param_groups:
                g["lr"] = 0.05
        stats = T.ppo_update(llm, loss, ac, opts, cfg, torch.Generator().manual_seed(0))
        with torch.no_grad():
            out = loss(llm)  # one minibatch = the whole batch: the same tokens the check measured
        results[rollback] = (float(out["kl_approx"]), stats)
    kept_kl, stats = results[True]
    assert kept_kl <= limit and stats["rolled_back"] == 1
    assert stats["step_fraction"] in (0.0, 0.125, 0.25, 0.5)  # backtracked, or undone
    overshoot, stats_mm = results[False]
    assert overshoot > limit and stats_mm["rolled_back"] == 0  # MiniMind's early stop keeps the jump


def test_rollback_with_a_limit_that_is_never_reached_changes_nothing():
    runs = []
    for rollback in (True, False):
        cfg, ac, loss, opts, llm = _rollout(ppo_epochs=2, minibatches=2, early_stop_kl=1e9, rollback=rollback)
        stats = T.ppo_update(llm, loss, ac, opts, cfg, torch.Generator().manual_seed(0))
        runs.append((_params(ac), stats))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1]["updates"] == runs[1][1]["updates"] == 4 and runs[0][1]["rolled_back"] == 0


def test_main_job_runs_two_iterations_and_writes_its_outputs(tmp_path):
    T.main(["--iterations", "2", "--out", str(tmp_path), "--no-progress"])
    rows = T.read_metrics(tmp_path / "metrics.csv")
    assert [r["iteration"] for r in rows] == [1.0, 2.0]
    assert set(T.METRICS) <= set(rows[0])
    assert 0.0 <= rows[0]["reward"] <= 1.0 and rows[0]["updates"] >= 1
    assert (tmp_path / "training.png").stat().st_size > 0
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert ckpt["iteration"] == 2
    assert {"actor_model", "critic_model", "actor_opt", "critic_opt", "kl_controller", "torch_rng"} <= set(ckpt)
    assert not list(tmp_path.glob("*.tmp"))  # the atomic write left no temporary file


def test_resume_continues_exactly_where_the_run_stopped(tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    T.main(["--iterations", "4", "--out", str(full), "--no-plot", *SMALL])
    T.main(["--iterations", "2", "--out", str(split), "--no-plot", *SMALL])
    T.main(["--iterations", "4", "--out", str(split), "--no-plot", "--resume", *SMALL])
    a, b = T.read_metrics(full / "metrics.csv"), T.read_metrics(split / "metrics.csv")
    assert [r["iteration"] for r in b] == [1.0, 2.0, 3.0, 4.0]
    for key in ("reward", "loss_objective", "loss_critic", "kl_ref", "kl_approx"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-5, abs=1e-7), key


def test_help_documents_every_flag():
    text = T.build_parser().format_help()
    for flag in ("--iterations", "--seed", "--device", "--out", "--resume", "--workers", "--early-stop-kl"):
        assert flag in text
    proc = subprocess.run([sys.executable, "-m", "ppo_objectives.train", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--kl-reward-coeff" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path, cli_error):
    err = cli_error(["--iterations", "1", "--device", "cuda", "--out", str(tmp_path)])
    assert "--device cuda was given but torch.cuda.is_available() is False; use --device cpu" in err


def test_config_rejects_bad_schedules():
    with pytest.raises(ValueError, match="TrainConfig minibatches=0 must be an int >= 1"):
        T.TrainConfig(minibatches=0)
    with pytest.raises(ValueError, match="TrainConfig lr=-1.0 must be a finite number > 0"):
        T.TrainConfig(lr=-1.0)


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), True])
def test_a_bad_trust_region_limit_is_a_clear_error(value):
    with pytest.raises(ValueError, match="early_stop_kl=.* must be a finite number >= 0"):
        T.TrainConfig(early_stop_kl=value)


def test_each_iteration_hands_the_freed_host_memory_back(monkeypatch, tmp_path):
    """glibc keeps freed heap pages; ``release_host_memory`` (called once per iteration) returns them."""
    import os

    from ppo_objectives.train import distributed, loop

    if distributed._glibc_malloc_trim() is None:
        pytest.skip("the C library is not glibc: release_host_memory does nothing here")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    kept, freed = [], []
    for i in range(4000):  # 64 KiB tensors, under glibc's mmap threshold: they live on the heap
        (kept if i % 2 else freed).append(torch.ones(16384))
    del freed  # 125 MiB freed between live tensors: nothing at the top of the heap to trim
    before = rss()
    assert distributed.release_host_memory()
    assert before - rss() > 64 * 2**20
    calls = []
    monkeypatch.setattr(loop, "release_host_memory", lambda: calls.append(1) or True)
    T.train(T.TrainConfig(iterations=2, warmup_steps=0, num_envs=4, save_every=100, no_progress=True, out=str(tmp_path)))
    assert len(calls) == 2


def test_a_callback_stops_the_run_with_a_checkpoint_and_resume_goes_on(tmp_path):
    seen = []

    def record(row, run):  # receives the logged row and the run it trains
        seen.append((row["iteration"], type(run.loss_module).__name__, (run.out / "metrics.csv").exists()))

    def stop_at_2(row, run):
        return row["iteration"] == 2

    out = tmp_path / "run"
    flags = dict(preset="pico", num_envs=8, warmup_steps=2, no_plot=True, no_progress=True, save_every=100)
    rows = T.train(T.TrainConfig(iterations=5, out=str(out), **flags), callbacks=[stop_at_2, record])
    assert [r["iteration"] for r in rows] == [1, 2]
    assert seen == [(1, "TokenPPOLoss", True), (2, "TokenPPOLoss", True)]  # every callback, after the row is logged
    assert torch.load(out / "checkpoint.pt", weights_only=False)["iteration"] == 2  # saved at the stop
    more = T.train(T.TrainConfig(iterations=3, out=str(out), resume=True, **flags))
    assert [r["iteration"] for r in more] == [3]


def test_a_callback_that_returns_nothing_lets_the_run_finish(tmp_path):
    calls = []
    rows = T.train(T.TrainConfig(iterations=2, preset="pico", num_envs=8, warmup_steps=2, no_plot=True,
                                 no_progress=True, out=str(tmp_path)), callbacks=[lambda row, run: calls.append(1)])
    assert len(rows) == 2 and len(calls) == 2


def test_the_pretrained_recipe_keeps_the_crossing_step_and_the_toy_recipe_pulls_it_back():
    assert T.TrainConfig().rollback is True
    assert T.TrainConfig(task="chat-add1", model="m").rollback is False
    assert T.TrainConfig(task="chat-add1", model="m", rollback=True).rollback is True
    args = T.build_parser().parse_args(["--task", "chat-add1", "--model", "m", "--rollback"])
    assert T.TrainConfig(**vars(args)).rollback is True


def test_a_run_without_a_kl_term_builds_no_reference_and_logs_no_reference_kl(tmp_path):
    seen = []
    cfg = T.TrainConfig(iterations=2, preset="pico", num_envs=8, warmup_steps=3, no_plot=True, no_progress=True,
                        kl_reward_coeff=0.0, out=str(tmp_path / "run"))
    assert not cfg.uses_reference
    rows = T.train(cfg, callbacks=[lambda row, run: seen.append((run.ref, run.kl_transform))])
    assert seen == [(None, None), (None, None)]
    assert all(math.isnan(r["kl_ref"]) and math.isnan(r["seq_kl"]) for r in rows)
    assert all(math.isfinite(r["loss_objective"]) for r in rows)
    assert "reference" not in torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    again = T.TrainConfig(**{**cfg.__dict__, "iterations": 3, "resume": True, "kl_reward_coeff": 0.02,
                             "allow_change": "kl_reward_coeff"})
    with pytest.raises(ValueError, match=r"--resume: the checkpoint holds no \['reference'\]"):
        T.train(again)


@pytest.mark.parametrize("flags", [dict(kl_reward_coeff=0.02), dict(kl_reward_coeff=0.0, kl_to_ref_coeff=0.1),
                                   dict(kl_reward_coeff=0.0, adaptive_kl=True)])
def test_every_kl_term_keeps_the_reference(flags):
    assert T.TrainConfig(**flags).uses_reference


def test_the_reference_alone_can_run_in_bf16(tmp_path):
    seen = []
    cfg = T.TrainConfig(iterations=1, preset="pico", num_envs=8, warmup_steps=3, no_plot=True, no_progress=True,
                        reference_dtype="bfloat16", out=str(tmp_path / "run"))
    rows = T.train(cfg, callbacks=[lambda row, run: seen.append(
        ({p.dtype for p in run.ref.parameters()}, {p.dtype for p in run.ac.actor_parameters()}))])
    assert seen == [({torch.bfloat16}, {torch.float32})]
    assert math.isfinite(rows[0]["kl_ref"])
    assert T.TrainConfig().reference_dtype == "float32" and T.TrainConfig(dtype="bfloat16").reference_dtype == "bfloat16"
    with pytest.raises(ValueError, match="--reference-dtype bfloat16 with --lora-rank: the reference is the actor's own"):
        T.TrainConfig(task="chat-add1", model="m", lora_rank=2, reference_dtype="bfloat16")
