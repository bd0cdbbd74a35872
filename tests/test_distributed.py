"""Data-parallel correctness on 2 CPU processes (gloo): N ranks with B rows == 1 process with N*B rows."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ppo_objectives.functional import (
    clipped_value_loss,
    loss_normalizer,
    masked_gae,
    masked_mean,
    masked_var,
    ppo_policy_loss,
    reference_kl_penalty,
)
from ppo_objectives.value.gae import MaskedGAE

WORLD = 2
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum",
         "token-sum-norm")  # fmt: skip


def _batch(seed=0, B=6, R=7, empty_rank1=False):
    """A global batch of B rows; rank r gets rows r::WORLD... here contiguous halves."""
    g = torch.Generator().manual_seed(seed)
    data = {k: torch.randn(B, R, generator=g, dtype=torch.float64) for k in ("r", "v", "new", "old", "ref", "vnew")}
    for k in ("new", "old", "ref"):  # log-probs are <= 0: the same draws moved below 0 (differences unchanged)
        data[k] = data[k] - 6.0
    mask = torch.rand(B, R, generator=g) > 0.3
    mask[0, 0] = True
    if empty_rank1:
        mask[B // 2 :] = False
    data["mask"] = mask
    return data


def _gae_tds(data):
    """The batch as MaskedGAE input, response layout and collector layout (done flags, next values)."""
    from tensordict import TensorDict

    B, R = data["mask"].shape
    llm = TensorDict({"state_value": data["v"], "mask": data["mask"], ("next", "reward"): data["r"]}, [B, R])
    col = llm.clone()
    done = torch.zeros(B, R, dtype=torch.bool)
    done[:, R // 2] = True
    col["next", "done"] = done
    col["next", "terminated"] = done & (data["new"][:, :1] > 0)  # per row, so shards agree with the whole
    col["next", "state_value"] = data["ref"]
    return llm, col


def _masked_gae_module(data, pg):
    return [MaskedGAE(0.99, 0.95, average_gae=True, process_group=pg)(td)["advantage"] for td in _gae_tds(data)]


def _shard(data, rank):
    B = data["mask"].shape[0]
    lo, hi = rank * B // WORLD, (rank + 1) * B // WORLD
    return {k: v[lo:hi] for k, v in data.items()}


def _losses(d, pg, mode, params):
    """Total loss with global normalisation; params = (log_prob, values) leaf tensors."""
    new, vnew = params
    m = d["mask"]
    norm = loss_normalizer(m, mode, process_group=pg)
    adv, ret = masked_gae(d["r"], d["v"], m, 1.0, 0.95, process_group=pg)
    pol = ppo_policy_loss(new, d["old"], adv, m, 0.2, aggregation=mode, normalizer=norm)
    kl = reference_kl_penalty(new, d["ref"], m, aggregation=mode, normalizer=norm)
    val = clipped_value_loss(vnew, d["v"], ret, m, 0.2, aggregation=mode, normalizer=norm)
    return pol + 0.02 * kl + 0.5 * val, adv


def _worker(rank, init_file, results_dir, empty_rank1):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        pg = dist.group.WORLD
        out = {}
        data = _shard(_batch(empty_rank1=empty_rank1), rank)
        for mode in MODES:
            new = data["new"].clone().requires_grad_()
            vnew = data["vnew"].clone().requires_grad_()
            loss, adv = _losses(data, pg, mode, (new, vnew))
            loss.backward()
            # DDP averages gradients over ranks: do the same by hand
            g_new, g_v = new.grad.clone(), vnew.grad.clone()
            loss_avg = loss.detach().clone()
            dist.all_reduce(loss_avg)
            out[mode] = {"loss": loss_avg / WORLD, "g_new": g_new / WORLD, "g_v": g_v / WORLD, "adv": adv.detach()}
        out["mean"] = masked_mean(data["v"], data["mask"], process_group=pg)
        out["var"] = masked_var(data["v"], data["mask"], process_group=pg)
        out["module_adv"] = _masked_gae_module(data, pg)

        # one DDP step on a tiny model: parameters identical on both ranks afterwards
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1).double()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)  # different data per rank
        x = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
        m = torch.rand(3, 5, generator=g) > (1.1 if (empty_rank1 and rank == 1) else 0.3)
        values = ddp(x).squeeze(-1)  # called through the wrapper so gradients synchronise
        ret = torch.randn(3, 5, generator=g, dtype=torch.float64)
        norm = loss_normalizer(m, process_group=pg)
        clipped_value_loss(values, values.detach(), ret, m, 10.0, normalizer=norm).backward()
        opt.step()
        out["params"] = torch.cat([p.detach().flatten() for p in model.parameters()])
        torch.save(out, os.path.join(results_dir, f"rank{rank}.pt"))
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without running destructors: tearing down a DDP Reducer and its gloo group at
    # interpreter exit can deadlock (the destructor holds the GIL while joining a gloo worker
    # thread that needs the GIL). The results are on disk and both ranks passed the barrier.
    os._exit(0)


def _run(empty_rank1=False):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(init_file, tmp, empty_rank1), nprocs=WORLD, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]


@pytest.fixture(scope="module")
def two_ranks():
    return _run()


@pytest.fixture(scope="module")
def two_ranks_one_empty():
    return _run(empty_rank1=True)


def _single_process(empty_rank1=False):
    data = _batch(empty_rank1=empty_rank1)
    out = {}
    for mode in MODES:
        new = data["new"].clone().requires_grad_()
        vnew = data["vnew"].clone().requires_grad_()
        loss, adv = _losses(data, None, mode, (new, vnew))
        loss.backward()
        out[mode] = {"loss": loss.detach(), "g_new": new.grad, "g_v": vnew.grad, "adv": adv.detach()}
    out["mean"] = masked_mean(data["v"], data["mask"])
    out["var"] = masked_var(data["v"], data["mask"])
    out["module_adv"] = _masked_gae_module(data, None)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_global_token_mean_loss_and_gradients_equal_single_process(two_ranks, mode):
    single = _single_process()
    half = single[mode]["g_new"].shape[0] // WORLD
    for rank, res in enumerate(two_ranks):
        torch.testing.assert_close(res[mode]["loss"], single[mode]["loss"], atol=1e-6, rtol=1e-6)
        rows = slice(rank * half, (rank + 1) * half)
        torch.testing.assert_close(res[mode]["g_new"], single[mode]["g_new"][rows], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(res[mode]["g_v"], single[mode]["g_v"][rows], atol=1e-6, rtol=1e-6)


def test_whitened_advantages_and_statistics_equal_single_process(two_ranks):
    single = _single_process()
    adv = torch.cat([res["token-mean"]["adv"] for res in two_ranks])
    torch.testing.assert_close(adv, single["token-mean"]["adv"], atol=1e-6, rtol=1e-6)
    for res in two_ranks:
        torch.testing.assert_close(res["mean"], single["mean"])
        torch.testing.assert_close(res["var"], single["var"])


def test_masked_gae_module_whitens_over_all_ranks_with_a_process_group(two_ranks):
    # MaskedGAE(process_group=): both layouts give the advantages of one process holding the whole batch
    single = _single_process()
    for layout in range(2):
        adv = torch.cat([res["module_adv"][layout] for res in two_ranks])
        torch.testing.assert_close(adv, single["module_adv"][layout], atol=1e-10, rtol=1e-10)
        local = torch.cat([_masked_gae_module(_shard(_batch(), r), None)[layout] for r in range(WORLD)])
        assert not torch.allclose(local, single["module_adv"][layout])  # without the group the ranks disagree


def test_ddp_step_leaves_identical_parameters_on_both_ranks(two_ranks):
    torch.testing.assert_close(two_ranks[0]["params"], two_ranks[1]["params"], atol=0, rtol=0)


def test_rank_with_all_zero_mask_does_not_hang_and_contributes_nothing(two_ranks_one_empty):
    single = _single_process(empty_rank1=True)
    for mode in MODES:
        for res in two_ranks_one_empty:
            torch.testing.assert_close(res[mode]["loss"], single[mode]["loss"], atol=1e-6, rtol=1e-6)
        assert (two_ranks_one_empty[1][mode]["g_new"] == 0).all()
    torch.testing.assert_close(two_ranks_one_empty[0]["params"], two_ranks_one_empty[1]["params"], atol=0, rtol=0)
