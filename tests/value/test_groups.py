"""Groups as part of the data: G responses per prompt from the env, a group id on every row of the
response layout, critic-free training in the job (--advantage grpo | dr_grpo | rloo | reinforce++)."""

from __future__ import annotations

import pytest
import torch
from torchrl.collectors import Collector

from ppo_objectives import GroupAdvantage
from ppo_objectives import train as T
from ppo_objectives.llm import ToLLMBatch
from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.models import TinyLMConfig
from ppo_objectives.llm.readouts import make_actor_critic
from ppo_objectives.train.digit import DigitTask

TASK = DigitTask("reverse", 3)


def test_a_full_reset_gives_each_prompt_to_group_size_rows():
    env = TokenLMEnv.from_task(TASK, num_envs=8, seed=0, group_size=4)
    td = env.reset()
    assert td["group"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    for g in (0, 1):
        rows = td["tokens"][td["group"] == g]
        assert (rows == rows[0]).all()  # one prompt per group
    assert td["prompt_id"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert env.reset()["group"].tolist() == [2, 2, 2, 2, 3, 3, 3, 3]  # a new draw: new group ids


def test_a_partial_reset_draws_singleton_groups_and_num_envs_must_fit():
    env = TokenLMEnv.from_task(TASK, num_envs=4, seed=0, group_size=2)
    env.reset()
    from tensordict import TensorDict

    td = env.reset(TensorDict(_reset=torch.tensor([[True], [False], [True], [False]]), batch_size=[4]))
    assert td["group"][0] != td["group"][2]  # rows that restart on their own: a group each
    with pytest.raises(ValueError, match="num_envs=6 is not a multiple of group_size=4.*num_envs=4"):
        TokenLMEnv.from_task(TASK, num_envs=6, group_size=4)


def test_collector_batches_carry_the_group_to_grpo_without_hand_made_grouping():
    torch.manual_seed(0)
    env = TokenLMEnv.from_task(TASK, num_envs=8, seed=0, group_size=4)
    ac = make_actor_critic(TinyLMConfig.preset("pico", vocab_size=16, block_size=8), env.prompt_len)
    col = Collector(env, ac.policy, frames_per_batch=8 * 4, total_frames=32, reset_at_each_iter=True,
                    auto_register_policy_transforms=False, postproc=ToLLMBatch(env.prompt_len, env.max_new_tokens))
    llm = next(iter(col))
    col.shutdown()
    assert "group" in llm.keys() and "prompt_id" in llm.keys()
    for g in llm["group"].unique().tolist():  # every row of a group answers the same prompt
        prompts = llm["input_ids"][llm["group"] == g][:, : env.prompt_len]
        assert (prompts == prompts[0]).all()
    sizes = torch.bincount(llm["group"])
    assert (sizes[sizes > 0] >= 1).all() and int(sizes.max()) == 4
    out = GroupAdvantage("grpo")(llm)  # reads 'group' by default
    assert out["advantage"].shape == llm["mask"].shape


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo", "reinforce++"])
def test_the_job_trains_without_a_critic(tmp_path, mode):
    cfg = T.TrainConfig(iterations=2, preset="pico", num_envs=8, warmup_steps=3, advantage=mode, out=str(tmp_path),
                        no_progress=True, no_plot=True)
    assert cfg.group_size == (1 if mode == "reinforce++" else 4)
    assert cfg.aggregation == T.ADVANTAGE_DEFAULTS[mode]["aggregation"]
    rows = T.train(cfg)
    assert rows[-1]["updates"] >= 1 and rows[-1]["loss_critic"] != rows[-1]["loss_critic"]  # nan: no critic loss
    assert rows[-1]["episodes"] >= 8


def test_critic_free_modes_refuse_critic_options():
    with pytest.raises(ValueError, match="--critic-warmup configure the critic, but --advantage grpo has none"):
        T.TrainConfig(advantage="grpo", critic_warmup=2)
    with pytest.raises(ValueError, match="--num-envs 10 is not a multiple of --group-size 4"):
        T.TrainConfig(advantage="grpo", num_envs=10)
    assert T.TrainConfig(advantage="grpo", kl_to_ref_coeff=0.1).kl_to_ref_coeff == 0.1  # a flag given wins
