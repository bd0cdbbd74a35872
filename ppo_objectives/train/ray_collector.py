"""Rollouts on Ray actors: TorchRL's own Ray collector (``Collector(backend="ray")``) over ``--workers`` actors.

Each actor runs a TorchRL ``Collector`` over its share of the env rows with its own copy of the
policy. After every update the learner pushes its weights with TorchRL's weight synchronisation
(``RayWeightSyncScheme``, the Ray collector's default), and every frame an actor collects carries
the ``"policy_version"`` of the weights that sampled it (TorchRL's ``PolicyVersion`` transform,
``track_policy_version=True``): the learner checks it against its own count of pushes
(:func:`~ppo_objectives.train.rollout.check_policy_version`) before it trains on the batch.

Without ``--ray-address`` a Ray instance is started on this machine for the run and shut down at its
end; with one (``auto``, ``HOST:6379``) the actors are placed on that cluster, whose every node must
have ``ppo_objectives`` installed. The actors roll out on CPU.
"""

from __future__ import annotations

import os

__all__ = ["ACTOR_RESOURCES", "RAY_INSTALL", "check_cluster_cpus", "cluster_address", "connect", "import_ray",
           "make_ray_collector", "ray_init_config"]

#: How to install what ``--collector-backend ray`` needs.
RAY_INSTALL = "pip install -e '.[ray]'"

#: Resources of one rollout actor: a CPU, no GPU (TorchRL's default asks for a fifth of a GPU).
ACTOR_RESOURCES = {"num_cpus": 1, "num_gpus": 0}


def import_ray():
    """The ``ray`` module, or a ``ModuleNotFoundError`` that says how to install it.

    Example:
        >>> import_ray().__name__  # installed with the ray (and test) extra
        'ray'
    """
    try:
        import ray
    except ImportError as err:
        raise ModuleNotFoundError(
            f"--collector-backend ray needs the ray package, which is not installed: {RAY_INSTALL}"
        ) from err
    return ray


def cluster_address(address: str) -> str:
    """The cluster a run joins: ``--ray-address``, else ``RAY_ADDRESS`` (which Ray itself obeys), else ``""`` (a
    local instance of its own).

    Example:
        >>> cluster_address("auto")
        'auto'
    """
    return address or os.environ.get("RAY_ADDRESS", "")


def ray_init_config(address: str, workers: int, world: int = 1) -> dict:
    """``ray.init``'s arguments: the cluster at ``address`` (or at ``RAY_ADDRESS``, which Ray itself obeys), or else
    a new local instance (``address="local"``: never the cluster a ``ray start`` left on this machine, which would
    refuse the CPU count) with a logical CPU for each of the ``workers * world`` actors, or the machine's CPUs if
    more. The actors' output stays in Ray's session logs (``/tmp/ray/session_latest/logs``; TorchRL's Ray collector
    prints each actor's collector there); their errors reach the learner as exceptions.

    Example:
        >>> ray_init_config("auto", workers=2)["address"]
        'auto'
        >>> ray_init_config("", workers=64)["num_cpus"]
        64
    """
    quiet = dict(configure_logging=False, log_to_driver=False)
    address = cluster_address(address)
    if address:
        return dict(address=address, **quiet)
    cpus = max(workers * world, os.cpu_count() or 1)
    return dict(address="local", num_cpus=cpus, include_dashboard=False, **quiet)


def check_cluster_cpus(ray, workers: int, world: int, address: str) -> None:
    """Refuse a cluster with fewer CPUs than the run's actors: TorchRL's Ray collector would wait for them forever.

    ``ray`` is the ``ray`` module (or anything with its ``cluster_resources()``).

    Example:
        >>> class OneCPU:
        ...     cluster_resources = staticmethod(lambda: {"CPU": 1.0})
        >>> check_cluster_cpus(OneCPU, workers=1, world=1, address="auto")  # enough: nothing happens
        >>> check_cluster_cpus(OneCPU, workers=2, world=1, address="auto")
        Traceback (most recent call last):
        ...
        RuntimeError: --ray-address auto: the cluster has 1 CPUs, and --workers 2 on 1 learner rank(s) need 2 ...
    """
    cpus = ray.cluster_resources().get("CPU", 0.0)
    need = workers * world
    if cpus < need:
        raise RuntimeError(
            f"--ray-address {address}: the cluster has {cpus:g} CPUs, and --workers {workers} on {world} learner "
            f"rank(s) need {need} (one per rollout actor); add nodes (ray start --address ...) or lower --workers"
        )


def connect(ray, init: dict) -> None:
    """``ray.init(**init)`` on a cluster; a refused connection says what to check, token authentication first
    (``ray start`` turns it on, and a client without ``RAY_AUTH_MODE=token`` is refused).

    Example:
        >>> class Refusing:
        ...     @staticmethod
        ...     def init(**kwargs):
        ...         raise ConnectionError("refused")
        >>> connect(Refusing, dict(address="10.0.0.1:6379"))
        Traceback (most recent call last):
        ...
        ConnectionError: --ray-address 10.0.0.1:6379: could not connect to the Ray cluster (refused). Check ...
    """
    try:
        ray.init(**init)
    except ConnectionError as err:
        raise ConnectionError(
            f"--ray-address {init['address']}: could not connect to the Ray cluster ({err}). Check that the head "
            "node runs (ray start --head) at that address, and, as ray start turns on token authentication, that "
            "this machine has RAY_AUTH_MODE=token and the head's token (~/.ray/auth_token, or RAY_AUTH_TOKEN)"
        ) from err


def make_ray_collector(factories: list, policy, frames_per_batch: int, *, address: str = "", world: int = 1):
    """TorchRL's Ray collector over one actor per env factory, synchronous (each batch stacks every actor's rows:
    ``[workers, rows, T]``), each actor's frames tagged with its ``"policy_version"``, and the learner's weights
    pushed once (version 1) before the first batch."""
    ray = import_ray()
    from torchrl.collectors import Collector

    workers = len(factories)
    init = ray_init_config(address, workers, world)
    if init["address"] != "local":
        if not ray.is_initialized():
            connect(ray, init)  # now, to check the cluster before TorchRL places actors on it
        check_cluster_cpus(ray, workers, world, init["address"])
    collector = Collector(
        factories, policy, backend="ray", num_collectors=workers, sync=True,
        frames_per_batch=frames_per_batch, total_frames=2**62,  # the Ray collector stops at total_frames; -1 is none
        reset_at_each_iter=True,
        backend_options=dict(
            ray_init_config=init, remote_configs=dict(ACTOR_RESOURCES),
            collector_kwargs=dict(track_policy_version=True, auto_register_policy_transforms=False),
        ),
    )  # fmt: skip
    collector.update_policy_weights_()  # the learner's weights as built (or resumed): version 1
    return collector
