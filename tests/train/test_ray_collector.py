"""Rollouts on Ray actors (``--collector-backend ray``) through TorchRL's own Ray collector.

On one local Ray instance (2 CPUs, started once for the module): Ray workers sample from the same
distribution as the in-process collector with the same weights (two-sample Kolmogorov-Smirnov
tests on each response's length and mean log-probability, and a negative control that must fail
them), every frame carries the version of the learner's latest push and a stale one is refused,
the workers' log-probabilities are the learner's on the tokens they sampled, and the job on Ray
actors writes the metrics of the job on worker processes, number for number.
The errors for what a Ray run cannot do need no Ray instance.
"""

import csv
import dataclasses
import re
import sys

import pytest
import torch
from _flags import SHORT

from ppo_objectives import train as T
from ppo_objectives.testing import reference_response_log_probs
from ppo_objectives.train.build import build, make_collector
from ppo_objectives.train.distributed import Dist
from ppo_objectives.train.ray_collector import check_cluster_cpus, connect, import_ray, ray_init_config

ray = pytest.importorskip("ray", reason="pip install -e '.[ray]'")

TIMING = {"rollout_s", "reference_s", "update_s", "tokens_per_s"}
KS_CRITICAL = 1.95  # the two-sample Kolmogorov-Smirnov statistic's critical value at alpha = 0.001: c * sqrt(1/n + 1/m)


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module (TorchRL's Ray collector uses it, and leaves it running)."""
    ray.init(**ray_init_config("", workers=2))
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def warm_run(local_ray, tmp_path_factory):
    """A warm-started pico policy, its env and its in-process collector (``build`` of a short job)."""
    cfg = T.TrainConfig(preset="pico", num_envs=16, warmup_steps=30, out=str(tmp_path_factory.mktemp("ray")))
    run = build(cfg, Dist())
    yield run
    run.collector.shutdown()


def _ray_collector(run, workers=2):
    cfg = dataclasses.replace(run.cfg, collector_backend="ray", workers=workers)
    return make_collector(cfg, run.task, run.ac.policy, run.env)


def _responses(run, collector, batches: int, version) -> tuple:
    """``batches`` collector batches as response-layout batches, and per response: length, mean log-prob."""
    it, llms = iter(collector), []
    for _ in range(batches):
        llms.append(T.collect_batch(it, run.device, run.P, run.M, policy_version=version))
    m = torch.cat([llm["mask"] for llm in llms])
    logp = torch.cat([llm["sample_log_prob"] for llm in llms])
    length = m.sum(-1).float()
    return llms, length, (logp * m).sum(-1) / length


def _ks(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """The two-sample Kolmogorov-Smirnov statistic of ``x`` and ``y``, and its critical value at alpha = 0.001."""
    z = torch.cat([x, y]).unique()
    cdf_x, cdf_y = (x[:, None] <= z).double().mean(0), (y[:, None] <= z).double().mean(0)
    n, m = len(x), len(y)
    return float((cdf_x - cdf_y).abs().max()), KS_CRITICAL * ((n + m) / (n * m)) ** 0.5


@pytest.mark.slow
def test_ray_workers_sample_the_in_process_distribution_and_follow_the_learners_pushes(warm_run):
    run = warm_run
    _, len_local, logp_local = _responses(run, run.collector, 20, None)
    collector = _ray_collector(run)
    try:
        llms, len_ray, logp_ray = _responses(run, collector, 20, 1)  # version 1: the push when built
        assert llms[0]["mask"].shape[0] == 16  # two actors' 8 rows each
        for local, remote in ((len_local, len_ray), (logp_local, logp_ray)):
            stat, critical = _ks(local, remote)
            assert stat < critical, (stat, critical)
        with torch.no_grad():
            for p in run.ac.actor_model.parameters():
                p.mul_(1.5)  # other weights: the negative control
        collector.update_policy_weights_()
        llms, len_new, logp_new = _responses(run, collector, 20, 2)  # every frame sampled with push 2
        for local, remote in ((len_local, len_new), (logp_local, logp_new)):
            stat, critical = _ks(local, remote)
            assert stat > critical, "the test must tell other weights apart"
        _assert_learners_log_probs(run, llms[-1])  # the workers sampled with the learner's (scaled) weights
        collector.update_policy_weights_()  # a push the check is not told about: version 3
        with pytest.raises(RuntimeError, match=r"sampled with version\(s\) \[3\], and the learner's latest .* 2"):
            T.collect_batch(iter(collector), run.device, run.P, run.M, policy_version=2)
    finally:
        collector.shutdown()
        with torch.no_grad():
            for p in run.ac.actor_model.parameters():
                p.div_(1.5)


def _assert_learners_log_probs(run, llm) -> None:
    """The log-probs a worker recorded are the learner's model's, recomputed by the kit one token at a time."""
    with torch.no_grad():
        logits = run.ac.actor_model(llm["input_ids"], llm["attention_mask"]).logits
    prompt_lens = torch.full((llm.batch_size[0],), run.P)
    expected = reference_response_log_probs(logits, llm["input_ids"], prompt_lens, run.M)
    m = llm["mask"]
    torch.testing.assert_close(llm["sample_log_prob"][m].double(), expected[m], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_ray_actors_give_the_metrics_of_worker_processes(local_ray, tmp_path):
    # each worker seeds its sampling stream from its env seed: the same rows, weights and draws on either backend
    flags = ["--iterations", "3", *SHORT, "--workers", "2"]
    runs = {}
    for name, extra in (("process", []), ("ray", ["--collector-backend", "ray"])):
        T.main([*flags, "--out", str(tmp_path / name), *extra])
        with open(tmp_path / name / "metrics.csv") as f:
            runs[name] = list(csv.DictReader(f))  # the written text: equal text is equal numbers, nan included
    assert [r["iteration"] for r in runs["ray"]] == ["1", "2", "3"]  # each iteration checked its batch's version
    assert all(int(r["episodes"]) >= 8 and int(r["updates"]) >= 1 for r in runs["ray"])
    for row, expected in zip(runs["ray"], runs["process"], strict=True):
        assert {k: v for k, v in row.items() if k not in TIMING} == {k: v for k, v in expected.items() if k not in TIMING}


def test_a_missing_ray_names_the_extra(monkeypatch, tmp_path, cli_error):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ModuleNotFoundError, match=re.escape("pip install -e '.[ray]'")):
        import_ray()
    err = cli_error(["--out", str(tmp_path), "--collector-backend", "ray"])
    assert "--collector-backend ray needs the ray package" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ray-address", "auto"], r"--ray-address auto places Ray rollout actors, but --collector-backend is proc"),
        (["--collector-backend", "ray", "--device", "cuda"], r"the Ray actors roll out on CPU"),
        (["--collector-backend", "ray", "--fsdp"], r"--fsdp --collector-backend ray: each Ray actor would receive"),
        (["--collector-backend", "ray", "--task", "chat-add1", "--model", "m"],
         r"--workers 1 --collector-backend ray with a text task"),
        (["--collector-backend", "spark"], r"invalid choice: 'spark'"),
    ],
    ids=["address-without-ray", "gpu-learner", "fsdp", "text-task", "unknown-backend"],
)
def test_what_a_ray_run_cannot_do_is_an_error(tmp_path, cli_error, flags, message):
    assert re.search(message, cli_error(["--out", str(tmp_path), *flags]))


def test_config_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match=r"collector_backend='spark' must be one of \('process', 'ray'\)"):
        T.TrainConfig(collector_backend="spark")


def test_ray_under_torchrun_needs_a_cluster_address(monkeypatch, tmp_path):
    for key, value in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="localhost", MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = T.TrainConfig(collector_backend="ray", out=str(tmp_path))
    with pytest.raises(ValueError, match=r"under torchrun \(2 ranks\) needs --ray-address"):
        T.check_launch(cfg)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # the cluster Ray itself would join: accepted
    T.check_launch(cfg)


def test_a_cluster_with_too_few_cpus_is_refused_before_actors_wait_for_them():
    class Cluster:  # ray.cluster_resources() of a one-CPU cluster
        @staticmethod
        def cluster_resources():
            return {"CPU": 1.0}

    with pytest.raises(RuntimeError, match=r"the cluster has 1 CPUs, and --workers 2 on 2 learner rank\(s\) need 4"):
        check_cluster_cpus(Cluster, workers=2, world=2, address="auto")
    check_cluster_cpus(Cluster, workers=1, world=1, address="auto")  # enough: nothing raised


def test_without_an_address_a_run_starts_its_own_instance_unless_ray_address_is_set(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    local = ray_init_config("", workers=2, world=3)
    # "local": a cluster that `ray start` left on the machine would capture a plain ray.init() and refuse num_cpus
    assert local["address"] == "local" and local["num_cpus"] >= 6
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_init_config("", workers=2) == dict(address="10.0.0.1:6379", configure_logging=False, log_to_driver=False)
    assert ray_init_config("auto", workers=2)["address"] == "auto"  # the flag wins over the environment


def test_a_refused_cluster_connection_says_what_to_check():
    class Refusing:  # ray.init on a cluster that refuses this client
        @staticmethod
        def init(**kwargs):
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")

    with pytest.raises(ConnectionError, match=r"--ray-address 10.0.0.1:6379: could not .* RAY_AUTH_MODE=token"):
        connect(Refusing, ray_init_config("10.0.0.1:6379", workers=2))
