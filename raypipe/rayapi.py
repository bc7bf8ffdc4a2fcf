"""Every use of Ray's private APIs, in one module: an upgrade of Ray breaks here, loudly.

raypipe reaches past Ray's public API in a few places, each for a reason its caller's
docstring gives; every such name is one of `INTERNALS`, read or called only through the
functions below (each imports Ray itself: importing this module costs nothing), and `check`
verifies them all against the running Ray (``tests/test_rayapi.py`` runs it, and checks by
reading the package that no other module touches a private name of Ray's).

```
 localnode        ray_constants.ENABLE_RAY_CLUSTER, services.get_ray_address_from_environment,
                  ray.init(_system_config=...), ray._raylet.Config.initialize
 cli.quiet        ray_logging.global_worker_stdstream_dispatcher (and its _lock), the
                  token-setup logger
 cli.jobapi       ray._raylet.AuthenticationTokenLoader
 pool.watch       ray._private.state: actors(), nodes()
 pool.autoscale   the streaming executor's _actor_autoscaler (its _topology) and
                  _cluster_autoscaler (its _send_resource_request); on an actor pool
                  _config, _running_actors, _release_running_actor and the two heaps
                  select_actors reads; ActorPoolScalingRequest.downscale
 loader.blocks    Dataset._create_executor, _build_bundle_iterator; the executor is its thread
 loader.errors    Ray Data's log of a failed task's error (DATA_ERROR_LOGGER, DATA_ERROR_ABORTS)
 train.ddp        the logger of a rank's error (TRAIN_ERROR_LOGGER)
 train.checkpoint ray.train.v2._internal.exceptions.CheckpointManagerInitializationError
 train.rendezvous ray.train.torch.config._TorchBackend, _set_torch_distributed_env_vars
```"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import threading

__all__ = [
    "AUTH_TOKEN_LOGGER", "DATA_ERROR_ABORTS", "DATA_ERROR_LOGGER", "INTERNALS", "RAY_VERSION",
    "TRAIN_ERROR_LOGGER", "actor_autoscaler", "actor_table", "address_from_environment",
    "auth_token_loader", "autoscaler_topology", "check", "check_names",
    "checkpoint_manager_error", "cluster_autoscaler", "cluster_flag_off", "downscale_request",
    "execute_to_iterator", "node_table", "pool_config", "release_actor", "running_actors",
    "scheduling_heaps", "set_actor_autoscaler", "set_cluster_autoscaler", "set_pool_config",
    "system_config", "torch_backend", "torch_env_vars", "withdraw_resource_request",
    "worker_log_handlers",
]  # fmt: skip
assert __all__ == sorted(__all__)

RAY_VERSION = "2.60.0"  # the Ray whose internals raypipe uses, checked by `check`
_CHECKING, _CHECKED = threading.Lock(), {}  # groups -> what `check_names` found
AUTH_TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"
TRAIN_ERROR_LOGGER = "ray.train.v2._internal.util"  # logs a rank's error with its traceback
DATA_ERROR_LOGGER = "ray.data._internal.execution.streaming_executor_state"  # a task's error
DATA_ERROR_ABORTS = "Dataset execution will now abort"  # its message when the error ends it
_EXECUTOR = "ray.data._internal.execution.streaming_executor"
_POOL = "ray.data._internal.execution.operators.actor_pool_map_operator"
_SCALER = "ray.data._internal.actor_autoscaler"

# (group, module, name, what it must be): "callable", "bool", "class", or the attributes,
# fields or parameters it must have (``attr:x``, ``field:x``, ``param:x``, ``source:text``)
INTERNALS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("localnode", "ray._private.ray_constants", "ENABLE_RAY_CLUSTER", ("bool",)),
    ("localnode", "ray._private.services", "get_ray_address_from_environment", ("param:temp_dir",)),
    ("localnode", "ray._raylet", "Config", ("attr:initialize",)),
    ("quiet", "ray._private.ray_logging", "global_worker_stdstream_dispatcher",
     ("attr:_lock", "attr:handlers")),
    ("submit", "ray._raylet", "AuthenticationTokenLoader", ("attr:instance",)),
    ("watch", "ray._private.state", "actors", ("param:actor_state_name",)),
    ("watch", "ray._private.state", "nodes", ("callable",)),
    ("blocks", "ray.data.dataset", "Dataset", ("attr:_create_executor", "attr:_build_bundle_iterator")),
    ("blocks", _EXECUTOR, "StreamingExecutor", ("attr:join", "attr:shutdown")),
    ("errors", DATA_ERROR_LOGGER, "process_completed_tasks",
     (f"source:{DATA_ERROR_ABORTS}", "source:logger.error(error_message, exc_info=e)")),
    ("checkpoint", "ray.train.v2._internal.exceptions", "CheckpointManagerInitializationError", ("class",)),
    ("ddp", TRAIN_ERROR_LOGGER, "construct_user_exception_with_traceback",
     ("source:Error in training function",)),
    ("rendezvous", "ray.train.torch.config", "_TorchBackend", ("class", "attr:on_start")),
    ("rendezvous", "ray.train.torch.config", "_set_torch_distributed_env_vars", ("callable",)),
    ("autoscale", _SCALER, "ActorPoolScalingRequest", ("attr:downscale", "param:force")),
    ("autoscale", f"{_SCALER}.autoscaling_actor_pool", "AutoscalingActorConfig",
     ("field:min_size", "field:max_size", "field:initial_size")),
    ("autoscale", _SCALER, "AutoscalingActorPool", ("source:self._config = config",)),
    ("autoscale", _SCALER, "ActorAutoscaler", ("source:self._topology = topology",)),
    ("autoscale", _POOL, "_ActorPool",
     ("attr:select_actors", "attr:scale", "attr:current_size", "attr:num_pending_actors",
      "attr:_release_running_actor", "source:self._running_actors",
      "source:self._alive_actors_to_in_flight_tasks_heap",
      "source:self._alive_node_to_actor_heap")),
    ("autoscale", _POOL, "_ActorState", ("field:num_tasks_in_flight", "field:actor_location")),
    ("autoscale", _EXECUTOR, "StreamingExecutor",
     ("attr:execute", "attr:shutdown", "source:self._actor_autoscaler = create_actor_autoscaler(",
      "source:self._cluster_autoscaler = create_cluster_autoscaler(")),
    ("autoscale", "ray.data._internal.cluster_autoscaler", "RateBasedClusterAutoscaler",
     ("attr:_send_resource_request",)),
)  # fmt: skip


def check(groups: tuple[str, ...] | None = None) -> list[str]:
    """What is wrong with this Ray for raypipe's uses of its internals (empty: nothing):
    the version, then every name of `INTERNALS` (of ``groups``, or all) and its shape."""
    import ray

    wrong = [f"Ray {ray.__version__} is not {RAY_VERSION}"] * (ray.__version__ != RAY_VERSION)
    return wrong + check_names(groups)


def check_names(groups: tuple[str, ...] | None = None) -> list[str]:
    """`check` without the version, once per process: a source check parses Ray's modules,
    and CPython 3.11's parser can fail with two threads at it (``SystemError``)."""
    with _CHECKING:
        if groups not in _CHECKED:
            _CHECKED[groups] = [p for entry in INTERNALS for p in _problems(groups, *entry)]
        return list(_CHECKED[groups])


def _problems(groups, group: str, module: str, name: str, shape: tuple[str, ...]) -> list[str]:
    if groups is not None and group not in groups:
        return []
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        return [f"{module}.{name} is gone ({type(e).__name__}: {e})"]
    return [f"{module}.{name}: {w}" for w in shape if not _has(obj, w)]


def _has(obj, want: str) -> bool:
    kind, _, arg = want.partition(":")
    if kind in ("bool", "callable", "class"):
        return {"bool": isinstance(obj, bool), "callable": callable(obj),
                "class": inspect.isclass(obj)}[kind]  # fmt: skip
    if kind == "attr":
        return hasattr(obj, arg)
    if kind == "field":
        return dataclasses.is_dataclass(obj) and arg in {f.name for f in dataclasses.fields(obj)}
    if kind == "param":
        fn = getattr(obj, "downscale", obj) if inspect.isclass(obj) else obj
        return arg in inspect.signature(fn).parameters
    if kind == "source":
        return arg in inspect.getsource(obj)
    raise ValueError(f"{want=}: not a shape")


# -- localnode: a new local node's address ------------------------------------------------
@contextlib.contextmanager
def cluster_flag_off():
    """``ray_constants.ENABLE_RAY_CLUSTER`` (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``) off in it."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def address_from_environment(address: str | None, temp_dir: str | None = None) -> str | None:
    """The cluster plain ``ray.init(address, _temp_dir=temp_dir)`` would join
    (``RAY_ADDRESS``, a cluster ``ray start`` left in that temp dir), or None."""
    from ray._private import services

    return services.get_ray_address_from_environment(address, temp_dir)


def reload_config() -> None:
    """This process's Ray config read again from the environment (``RAY_AUTH_MODE``), as
    Ray's own token setup does after it sets the variable."""
    from ray._raylet import Config

    Config.initialize("")


def system_config(config: dict) -> dict:
    """``ray.init`` keywords that give a new local Ray ``config`` as its system config."""
    return {"_system_config": config}


# -- cli: the driver's log printer, the token a job client sends --------------------------
@contextlib.contextmanager
def worker_log_handlers():
    """The driver's list of ``(name, handler)`` of its workers' output, under its lock;
    None where this Ray has no such printer."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        yield None
        return
    with dispatcher._lock:
        yield dispatcher.handlers


def auth_token_loader():
    """Ray's loader of the authentication token (the one ``ray start`` wrote)."""
    from ray._raylet import AuthenticationTokenLoader

    return AuthenticationTokenLoader.instance()


# -- pool.watch: the GCS's actor and node tables; loader.blocks: an execution -------------
def actor_table(state: str | None) -> dict:
    """The cluster's actors in ``state`` (``"ALIVE"``...; None: any, dead too), by id."""
    from ray._private import state as gcs

    return gcs.actors(actor_state_name=state)


def node_table() -> list[dict]:
    """Every node the GCS knows, alive or not."""
    from ray._private import state as gcs

    return gcs.nodes()


def execute_to_iterator(ds):
    """``(RefBundle iterator, executor)`` of ``ds``'s streaming execution, started here."""
    executor = ds._create_executor()
    return iter(ds._build_bundle_iterator(executor)), executor


# -- train --------------------------------------------------------------------------------
def checkpoint_manager_error() -> type[BaseException]:
    """What Ray Train raises reading a run folder while it rewrites its state."""
    from ray.train.v2._internal.exceptions import CheckpointManagerInitializationError

    return CheckpointManagerInitializationError


def torch_backend() -> type:
    """Ray Train's torch backend class, which ``TorchConfig`` starts process groups with."""
    from ray.train.torch.config import _TorchBackend

    return _TorchBackend


def torch_env_vars():
    """The function Ray Train runs on every worker to set its torch.distributed variables."""
    from ray.train.torch.config import _set_torch_distributed_env_vars

    return _set_torch_distributed_env_vars


# -- pool.autoscale: the executor's autoscalers and actor pools ---------------------------
def actor_autoscaler(executor):
    """The executor's actor autoscaler, None where it has none."""
    return getattr(executor, "_actor_autoscaler", None)


def set_actor_autoscaler(executor, autoscaler) -> None:
    executor._actor_autoscaler = autoscaler


def cluster_autoscaler(executor):
    """Its cluster autoscaler; None if none, none sending, or a placement group's."""
    cluster = getattr(executor, "_cluster_autoscaler", None)
    group = type(cluster).__name__ == "PlacementGroupClusterAutoscaler"
    return cluster if hasattr(cluster, "_send_resource_request") and not group else None


def set_cluster_autoscaler(executor, autoscaler) -> None:
    executor._cluster_autoscaler = autoscaler


def withdraw_resource_request(cluster) -> None:
    """Withdraw ``cluster``'s standing request for nodes (an empty request)."""
    cluster._send_resource_request([])


def autoscaler_topology(autoscaler):
    """The operators an actor autoscaler looks after."""
    return autoscaler._topology


def downscale_request(delta: int, reason: str):
    """A forced request to shrink an actor pool by ``-delta`` actors."""
    from ray.data._internal.actor_autoscaler import ActorPoolScalingRequest

    return ActorPoolScalingRequest.downscale(delta=delta, force=True, reason=reason)


def running_actors(pool) -> dict:
    """The pool's running actors: actor → state (``num_tasks_in_flight``, ``actor_location``)."""
    return pool._running_actors


def release_actor(pool, actor) -> None:
    """Stop ``actor`` (idle) and take it out of the pool: the one chosen, not any idle one."""
    pool._release_running_actor(actor)


def pool_config(pool):
    """The pool's ``AutoscalingActorConfig`` (``min_size``, ``max_size``, ``initial_size``)."""
    return pool._config


def set_pool_config(pool, config) -> None:
    pool._config = config


def scheduling_heaps(pool) -> list[dict]:
    """The heaps ``pool.select_actors`` picks from (actor → rank), the pool's and each node's."""
    return [pool._alive_actors_to_in_flight_tasks_heap, *pool._alive_node_to_actor_heap.values()]
