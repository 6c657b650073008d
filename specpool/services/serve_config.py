"""Served mode configuration: the args of the three application builders, validated, and the Serve
config that ``specpool serve`` runs by default.

The builders in ``specpool/services/serve_app.py`` get their ``args`` from a Serve config file (KubeRay's
``serveConfigV2``, ``specpool serve --config FILE``). Every key is parsed here into a frozen
dataclass, with one clear message per mistake (unknown key, wrong type, out of range), before any
model loads. Pure: no Ray, no models.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from specpool.core.defaults import (DEFAULT_BETA, DEFAULT_K, DEFAULT_TARGET, DEFAULT_MAX_NEW_TOKENS, DEFAULT_POLICY,
                                     DEFAULT_PROBE_ROUNDS, MAX_DRAFT_LENGTH)
from specpool.core.errors import InvalidArgument, NotFound
from specpool.router.session_store import TENANT_PATTERN

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_GRPC_HOST = "127.0.0.1"  # where `specpool serve` says to connect (Serve's proxy binds all interfaces)
DEFAULT_GRPC_PORT = 50051
DEFAULT_HTTP_PORT = 8000  # Serve's HTTP proxy: the OpenAI-compatible API (router arg http_api)
DEFAULT_METRICS_PORT = 9464  # Prometheus text format at http://HOST:9464/metrics (Ray's metrics agent)
GRPC_SERVICER_FUNCTIONS = (
    "specpool.services.grpc_ingress.add_specpool_servicer_to_server",  # the generated one, tolerant of bad bytes
    # Serve's proxy routes grpc.health.v1.Health/Check to the router's `Check` method.
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
)
ROUTER_IMPORT_PATH = "specpool.services.serve_app:build_router_app"
TARGET_IMPORT_PATH = "specpool.services.serve_app:build_target_app"
DRAFTER_IMPORT_PATH = "specpool.services.serve_app:build_drafter_app"

# Ray Serve settings for a data path of two deployment calls per round (propose, verify), each a
# few milliseconds of a ~100 ms round. Every Ray process reads them from its environment at start:
# `specpool serve` sets them (unless already set) before it starts Ray, and k8s/rayservice.yaml on
# every container. Measured on 2 cores: a deployment call from a driver thread 4.3 -> 2.7 ms (median
# of 280), the idle cluster's CPU 27 % -> 18 % of a core.
SERVE_ENV = {
    # Replicas run our async methods on Serve's own event loop, not a second one in another thread:
    # one thread hop less per call. Everything that blocks already runs in our own executors.
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    # Routers and replicas export their cached metrics once a second instead of ten times.
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    # The controller's reconcile loop at 2 Hz instead of 10 Hz: deploys and replacing a dead
    # replica react up to 0.4 s later; requests do not pass through it.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # Calls between replicas carry the target's features for white-box arms (1,152 bytes a
    # position on the default target): a prefill of a long prompt exceeds Serve's 4 MB default.
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": "67108864",
}
# Serve's logging for the target and drafter applications (a Serve config's per-application
# `logging_config`): warnings only, no access log. Their calls are internal, two per round of every
# session; at Serve's default (INFO, access log on) each one also formats and buffers a log line,
# which py-spy showed as the largest item of a drafter replica's per-call work after our own code.
# The router application keeps Serve's default: one access-log line per client request.
MODEL_APP_LOGGING = {"log_level": "WARNING", "enable_access_log": False}
# GIL switch interval in every replica (specpool/services/serve_app.py, _quick_thread_switches): 0.5 ms
# instead of CPython's 5 ms. 0.1 ms measured no better.
REPLICA_SWITCH_INTERVAL_S = 0.0005
_DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")
_DTYPES = ("auto", "float32", "float16", "bfloat16")
FEATURE_DTYPES = ("float16", "bfloat16")  # = specpool.target.features.WIRE_DTYPES (this module stays torch-free)
_APP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
_MISSING = object()


# -- field checks -------------------------------------------------------------------------------------
def _int(where: str, key: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{where}: {key} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in {low}..{high}"
        raise InvalidArgument(f"{where}: {key} must be {bounds}, got {value}")
    return value


def _float(where: str, key: str, value: Any, low: float = 0.0, inclusive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(f"{where}: {key} must be a number, got {value!r}")
    if value < low or (not inclusive and value == low):
        raise InvalidArgument(f"{where}: {key} must be {'>=' if inclusive else '>'} {low}, got {value}")
    return float(value)


def _str(where: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"{where}: {key} must be a non-empty string, got {value!r}")
    return value


def _device(where: str, value: Any) -> str:
    value = _str(where, "device", value)
    if not _DEVICE.match(value):
        raise InvalidArgument(f"{where}: unknown device {value!r}; use cpu, cuda or cuda:N")
    return value


def _dtype(where: str, value: Any) -> str:
    value = _str(where, "dtype", value)
    if value not in _DTYPES:
        raise InvalidArgument(f"{where}: unknown dtype {value!r}; use one of {', '.join(_DTYPES)}")
    return value


def _actor_options(where: str, value: Any, device: str | None) -> dict:
    """``ray_actor_options``: num_cpus and num_gpus checked; other keys (memory, resources,
    runtime_env, ...) go to Ray as they are. A CUDA device needs a GPU: Ray hides every GPU from
    an actor that asked for none (CUDA_VISIBLE_DEVICES is emptied)."""
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{where}: ray_actor_options must be a mapping such as {{num_cpus: 1, num_gpus: 0}}, got {value!r}")
    options = dict(value)
    for key in ("num_cpus", "num_gpus"):
        if key in options:
            _float(where, f"ray_actor_options.{key}", options[key])
    if device is not None and device.startswith("cuda") and not options.get("num_gpus"):
        raise InvalidArgument(f"{where}: device {device} needs a GPU: set ray_actor_options.num_gpus > 0 (e.g. 1, or 0.5 to share one)")
    return options


def torch_threads_for(options: Mapping, explicit: int | None) -> int:
    """Intra-op threads of a model replica: as many as CPUs it reserved (at least one)."""
    if explicit is not None:
        return explicit
    return max(1, int(options.get("num_cpus", 1) or 0))


def _unknown_keys(where: str, args: Mapping, cls: type) -> None:
    known = [f.name for f in fields(cls)]
    for key in args:
        if key not in known:
            raise InvalidArgument(f"{where}: unknown key {key!r} (known: {', '.join(known)})")


def _mapping(where: str, args: Any) -> Mapping:
    if args is None:
        return {}
    if not isinstance(args, Mapping):
        raise InvalidArgument(f"{where}: args must be a mapping, got {type(args).__name__}")
    return args


# -- the three builders' args ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterArgs:
    """``build_router_app`` args: the gRPC ingress."""

    drafter_apps: tuple[tuple[str, str], ...]  # (drafter name, application serving it), in pool order
    redis_url: str = DEFAULT_REDIS_URL  # session and tenant bandit state
    policy: str = DEFAULT_POLICY  # a request may name another ("fixed:code", "thompson+warm")
    k: int = DEFAULT_K  # default draft length; a request may ask for 1..MAX_DRAFT_LENGTH
    target_app: str = "target"  # the application serving the target's verification
    num_replicas: int = 1
    ray_actor_options: dict = field(default_factory=lambda: {"num_cpus": 1, "num_gpus": 0})
    max_ongoing_requests: int = 64  # concurrent requests per router replica (each runs its loop in a thread)
    redis_namespace: str = "specpool"  # key prefix: {namespace}:{tenant}:session:{id}
    session_ttl_s: float = 3600.0  # a session's bandit state expires this long after its last round
    beta: float = DEFAULT_BETA  # UCB exploration weight of the bandit policies
    probe_rounds: int = DEFAULT_PROBE_ROUNDS  # ucb-replay: a session's first rounds in which every drafter is replayed
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # when a request leaves max_new_tokens at 0
    retry_s: float = 60.0  # how long a round retries a model server that is unavailable (replica replaced)
    # Deadlines (specpool/services/remote.py says why these values): a drafter call's, after which
    # the round runs target-only and the drafter is skipped for a cooldown; and any call's to the
    # target, retries included, after which the request fails with DEADLINE_EXCEEDED.
    drafter_timeout_s: float = 2.0
    call_timeout_s: float = 120.0
    transport: str = "grpc"  # "grpc": calls to the target and drafters travel over Serve's replica gRPC; "actor": Ray actor calls
    # After a session's first call through Serve, call the replica holding its caches directly when
    # it is on the router's node (specpool/services/direct.py); false: every call through Serve.
    direct_calls: bool = True
    # Online learning: every verified round becomes a record on this Redis stream (at redis_url)
    # for `specpool learner`; the target then also returns its top-K p per position.
    feedback: bool = False
    feedback_stream: str = "specpool:feedback"
    feedback_top_k: int = 20  # entries of the target's p per position in a record (1..64)
    feedback_opt_out: tuple[str, ...] = ()  # tenants whose rounds are never sent
    feedback_maxlen: int = 100_000  # records kept per tenant's feedback stream (MAXLEN ~)
    # The OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health)
    # on Serve's HTTP proxy, beside gRPC; false: every HTTP path answers 404.
    http_api: bool = True
    # API keys -> tenants (specpool/services/auth.py): a key file of SHA-256 hashes; None: the
    # SPECPOOL_API_KEYS environment variable if set, else no keys (every request names its tenant).
    api_keys_file: str | None = None
    # Per-tenant quotas (specpool/services/admission.py): max_concurrent, tokens_per_minute,
    # max_prompt_bytes, max_new_tokens, shared over router replicas in Redis; None: no quotas.
    quotas_file: str | None = None
    # Serve's bounded queue in front of each router replica: a request past it is refused at once
    # (gRPC RESOURCE_EXHAUSTED; HTTP 429 with Retry-After) instead of waiting; -1: unbounded.
    max_queued_requests: int = 256
    # Read the Redis URL from this environment variable of the router's process instead of
    # redis_url (Kubernetes: the password comes from a Secret through env; serveConfigV2 cannot
    # expand variables, and a URL written there would show its password in the Serve config).
    redis_url_env: str | None = None

    def resolved_redis_url(self, environ: Mapping[str, str] | None = None) -> str:
        """The Redis URL to connect to: redis_url, or the value of $redis_url_env (read where the
        router runs, not where the config is parsed)."""
        if self.redis_url_env is None:
            return self.redis_url
        url = (os.environ if environ is None else environ).get(self.redis_url_env, "")
        if not url:
            raise InvalidArgument(f"router args: redis_url_env is {self.redis_url_env}, but that environment variable is not set here")
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidArgument(f"router args: ${self.redis_url_env} must be redis://HOST:PORT/DB, rediss://... or unix:///path")
        return url

    @property
    def pool(self) -> list[str]:
        return [name for name, _ in self.drafter_apps]

    @classmethod
    def parse(cls, args: Any) -> "RouterArgs":
        where = "router args"
        args = _mapping(where, args)
        _unknown_keys(where, args, cls)
        apps = args.get("drafter_apps", _MISSING)
        if apps is _MISSING:
            raise InvalidArgument(f"{where}: drafter_apps is required: a mapping of drafter name -> application, e.g. {{ngram: drafter-ngram}}")
        if not isinstance(apps, Mapping) or not apps:
            raise InvalidArgument(f"{where}: drafter_apps must be a non-empty mapping of drafter name -> application, got {apps!r}")
        pairs = []
        for name, app in apps.items():
            _str(where, "a drafter_apps name", name)
            if not isinstance(app, str) or not _APP_NAME.match(app):
                raise InvalidArgument(f"{where}: drafter_apps[{name!r}] must be an application name, got {app!r}")
            pairs.append((name, app))
        target_app = args.get("target_app", "target")  # drafters it hosts all map to it (specpool/router/hosted.py)
        if len({app for _, app in pairs if app != target_app}) != sum(1 for _, app in pairs if app != target_app):
            raise InvalidArgument(f"{where}: drafter_apps names one application for two drafters: {dict(pairs)}")
        out: dict[str, Any] = {"drafter_apps": tuple(pairs)}
        if "redis_url" in args:
            url = _str(where, "redis_url", args["redis_url"])
            if not url.startswith(("redis://", "rediss://", "unix://")):
                raise InvalidArgument(f"{where}: redis_url must be redis://HOST:PORT/DB, rediss://... or unix:///path, got {url!r}")
            out["redis_url"] = url
        if args.get("redis_url_env") is not None:
            if "redis_url" in args:
                raise InvalidArgument(f"{where}: give redis_url or redis_url_env, not both")
            name = _str(where, "redis_url_env", args["redis_url_env"])
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise InvalidArgument(f"{where}: redis_url_env must be an environment variable name, got {name!r}")
            out["redis_url_env"] = name
        if "policy" in args:
            out["policy"] = _str(where, "policy", args["policy"])
        if "k" in args:
            out["k"] = _int(where, "k", args["k"], 1, MAX_DRAFT_LENGTH)
        if "target_app" in args:
            target_app = _str(where, "target_app", args["target_app"])
            if not _APP_NAME.match(target_app):
                raise InvalidArgument(f"{where}: target_app must be an application name, got {target_app!r}")
            out["target_app"] = target_app
        if "num_replicas" in args:
            out["num_replicas"] = _int(where, "num_replicas", args["num_replicas"], 1)
        if "ray_actor_options" in args:
            out["ray_actor_options"] = _actor_options(where, args["ray_actor_options"], None)
        if "max_ongoing_requests" in args:
            out["max_ongoing_requests"] = _int(where, "max_ongoing_requests", args["max_ongoing_requests"], 1)
        if "redis_namespace" in args:
            namespace = _str(where, "redis_namespace", args["redis_namespace"])
            if not _NAMESPACE.match(namespace):
                raise InvalidArgument(f"{where}: redis_namespace must be 1-64 characters from A-Z a-z 0-9 _ . : -, got {namespace!r}")
            out["redis_namespace"] = namespace
        if "session_ttl_s" in args:
            out["session_ttl_s"] = _float(where, "session_ttl_s", args["session_ttl_s"], 0.0, inclusive=False)
        if "beta" in args:
            out["beta"] = _float(where, "beta", args["beta"], 0.0, inclusive=False)
        if "probe_rounds" in args:
            out["probe_rounds"] = _int(where, "probe_rounds", args["probe_rounds"], 1)
        if "max_new_tokens" in args:
            out["max_new_tokens"] = _int(where, "max_new_tokens", args["max_new_tokens"], 1)
        if "retry_s" in args:
            out["retry_s"] = _float(where, "retry_s", args["retry_s"])
        for name in ("drafter_timeout_s", "call_timeout_s"):
            if name in args:
                out[name] = _float(where, name, args[name], 0.0, inclusive=False)
        if "transport" in args:
            if args["transport"] not in ("grpc", "actor"):
                raise InvalidArgument(f"{where}: transport must be grpc or actor, got {args['transport']!r}")
            out["transport"] = args["transport"]
        if "direct_calls" in args:
            if not isinstance(args["direct_calls"], bool):
                raise InvalidArgument(f"{where}: direct_calls must be true or false, got {args['direct_calls']!r}")
            out["direct_calls"] = args["direct_calls"]
        if "feedback" in args:
            if not isinstance(args["feedback"], bool):
                raise InvalidArgument(f"{where}: feedback must be true or false, got {args['feedback']!r}")
            out["feedback"] = args["feedback"]
        if "feedback_stream" in args:
            out["feedback_stream"] = _str(where, "feedback_stream", args["feedback_stream"])
        if "feedback_top_k" in args:
            out["feedback_top_k"] = _int(where, "feedback_top_k", args["feedback_top_k"], 1, 64)
        if "feedback_opt_out" in args:
            tenants = args["feedback_opt_out"]
            if not isinstance(tenants, (list, tuple)) or not all(isinstance(t, str) and TENANT_PATTERN.fullmatch(t) for t in tenants):
                raise InvalidArgument(f"{where}: feedback_opt_out must be a list of tenant ids, got {tenants!r}")
            out["feedback_opt_out"] = tuple(tenants)
        if "feedback_maxlen" in args:
            out["feedback_maxlen"] = _int(where, "feedback_maxlen", args["feedback_maxlen"], 1)
        if "http_api" in args:
            if not isinstance(args["http_api"], bool):
                raise InvalidArgument(f"{where}: http_api must be true or false, got {args['http_api']!r}")
            out["http_api"] = args["http_api"]
        if args.get("api_keys_file") is not None:
            out["api_keys_file"] = _str(where, "api_keys_file", args["api_keys_file"])
        if args.get("quotas_file") is not None:
            out["quotas_file"] = _str(where, "quotas_file", args["quotas_file"])
        if "max_queued_requests" in args:
            queued = args["max_queued_requests"]
            if queued != -1:
                queued = _int(where, "max_queued_requests", queued, 1)
            out["max_queued_requests"] = queued
        parsed = cls(**out)
        parsed.check_policy()
        parsed.check_api_keys()
        parsed.check_quotas()
        return parsed

    def check_quotas(self) -> None:
        """A missing or malformed quota file, or a quota for a tenant no API key acts as, is one
        clear line at start-up."""
        from specpool.services.admission import load_quotas
        from specpool.services.auth import load_api_keys

        keys = load_api_keys(self.api_keys_file)
        load_quotas(self.quotas_file, keys.tenants if keys.enabled else None)

    def check_api_keys(self) -> None:
        """A key file that is missing or malformed is one clear line at start-up, not a router
        replica that fails to start."""
        from specpool.services.auth import load_api_keys

        load_api_keys(self.api_keys_file)

    def check_policy(self) -> None:
        """The default policy must exist and only choose among the served drafters."""
        # Here, not at the top: this module stays torch-free for the CLI's argument parsing and
        # Serve's config checks; the policies (and the drafter registry below) bring torch.
        from specpool.router.policies import PolicyOptions, make_policy, parse_arm

        policy = make_policy(self.policy, self.pool, PolicyOptions(beta=self.beta, probe_rounds=self.probe_rounds))
        missing = [d for d in dict.fromkeys(parse_arm(a)[0] for a in policy.arms) if d not in self.pool]
        if missing:
            raise NotFound(f"router args: policy {self.policy!r} uses drafter {missing[0]!r}, which drafter_apps does not serve "
                           f"(served: {', '.join(self.pool)})")


@dataclass(frozen=True)
class TargetArgs:
    """``build_target_app`` args: the target model's verification, batched over sessions."""

    model: str = DEFAULT_TARGET  # embedded name, local folder or Hugging Face hub id
    device: str = "cpu"
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    cache_capacity: int = 64  # sessions whose KV caches stay resident per replica (least recently used evicted)
    max_batch_size: int = 8  # verify calls of concurrent sessions joined into one forward
    batch_wait_timeout_s: float = 0.05  # most a batch waits for the calls of the previous batch's other sessions
    num_replicas: int = 1
    ray_actor_options: dict = field(default_factory=lambda: {"num_cpus": 1, "num_gpus": 0})
    max_ongoing_requests: int | None = None  # None: 4 x max_batch_size, at least 32
    torch_threads: int | None = None  # None: the replica's num_cpus (at least 1)
    # Wire encoding of the features white-box drafters read (2 bytes a value either way):
    # float16 by default; bfloat16 for a target whose hidden states overflow float16's range.
    feature_dtype: str = "float16"
    # Drafters this deployment hosts (specpool/router/hosted.py): it drafts with them inside the
    # verify call, white-box heads reading its features in process; the router maps each such name
    # to this application in its drafter_apps.
    hosted_drafters: tuple[str, ...] = ()
    # With hosted drafters: a batch of several sessions drafts only where drafting has measured
    # faster than plain batched decoding at that batch size (``LoadGate``, specpool/router/hosted.py).
    load_gate: bool = True

    @property
    def ongoing(self) -> int:
        return self.max_ongoing_requests or max(32, 4 * self.max_batch_size)

    @property
    def threads(self) -> int:
        return torch_threads_for(self.ray_actor_options, self.torch_threads)

    @classmethod
    def parse(cls, args: Any) -> "TargetArgs":
        where = "target args"
        args = _mapping(where, args)
        _unknown_keys(where, args, cls)
        out: dict[str, Any] = {}
        if "model" in args:
            out["model"] = _str(where, "model", args["model"])
        device = out["device"] = _device(where, args.get("device", "cpu"))
        out["dtype"] = _dtype(where, args.get("dtype", "auto"))
        if "cache_capacity" in args:
            out["cache_capacity"] = _int(where, "cache_capacity", args["cache_capacity"], 1)
        if "max_batch_size" in args:
            out["max_batch_size"] = _int(where, "max_batch_size", args["max_batch_size"], 1, 256)
        if "batch_wait_timeout_s" in args:
            out["batch_wait_timeout_s"] = _float(where, "batch_wait_timeout_s", args["batch_wait_timeout_s"])
        if "num_replicas" in args:
            out["num_replicas"] = _int(where, "num_replicas", args["num_replicas"], 1)
        out["ray_actor_options"] = _actor_options(where, args.get("ray_actor_options", {"num_cpus": 1, "num_gpus": 0}), device)
        if args.get("max_ongoing_requests") is not None:
            out["max_ongoing_requests"] = _int(where, "max_ongoing_requests", args["max_ongoing_requests"], 1)
        if args.get("torch_threads") is not None:
            out["torch_threads"] = _int(where, "torch_threads", args["torch_threads"], 1)
        if "feature_dtype" in args:
            if args["feature_dtype"] not in FEATURE_DTYPES:
                raise InvalidArgument(f"{where}: feature_dtype must be one of {', '.join(FEATURE_DTYPES)}, got {args['feature_dtype']!r}")
            out["feature_dtype"] = args["feature_dtype"]
        if args.get("hosted_drafters") is not None:
            hosted = args["hosted_drafters"]
            if not isinstance(hosted, (list, tuple)) or not all(isinstance(h, str) and h for h in hosted):
                raise InvalidArgument(f"{where}: hosted_drafters must be a list of drafter names, got {hosted!r}")
            if len(set(hosted)) != len(hosted):
                raise InvalidArgument(f"{where}: hosted_drafters names a drafter twice: {list(hosted)}")
            out["hosted_drafters"] = tuple(hosted)
        if "load_gate" in args:
            if not isinstance(args["load_gate"], bool):
                raise InvalidArgument(f"{where}: load_gate must be true or false, got {args['load_gate']!r}")
            out["load_gate"] = args["load_gate"]
        parsed = cls(**out)
        if parsed.ongoing < parsed.max_batch_size:
            raise InvalidArgument(f"{where}: max_ongoing_requests ({parsed.ongoing}) must be >= max_batch_size "
                                  f"({parsed.max_batch_size}), or batches never fill")
        return parsed


@dataclass(frozen=True)
class DrafterArgs:
    """``build_drafter_app`` args: one drafter of the pool."""

    name: str  # drafter spec as in `specpool generate --drafter`: ngram, code, zoo:PATH, hf:PATH, ...
    target: str = DEFAULT_TARGET  # the target model, for drafters derived from it (zoo: its embeddings)
    device: str = "cpu"
    dtype: str = "auto"
    num_replicas: int = 1
    ray_actor_options: dict = field(default_factory=lambda: {"num_cpus": 0.5, "num_gpus": 0})
    max_ongoing_requests: int = 64
    torch_threads: int | None = None  # None: the replica's num_cpus (at least 1)
    # Online learning: the model store `specpool learner` publishes to (a folder or file:// URI on
    # a filesystem every replica sees). Set, a zoo drafter drafts each tenant's request with the
    # tenant's serving version (one shared variant with learn_shared), checked every refresh_s.
    model_store: str | None = None
    learn_shared: bool = False
    refresh_s: float = 5.0
    max_tenants: int = 256  # learned-variant slots per replica (least recently used out)

    @property
    def threads(self) -> int:
        return torch_threads_for(self.ray_actor_options, self.torch_threads)

    @classmethod
    def parse(cls, args: Any) -> "DrafterArgs":
        where = "drafter args"
        args = _mapping(where, args)
        _unknown_keys(where, args, cls)
        if "name" not in args:
            raise InvalidArgument(f"{where}: name is required: the drafter spec, e.g. ngram or code")
        name = _str(where, "name", args["name"])
        where = f"drafter args ({name})"
        from specpool.drafters.registry import drafter_kinds, known_spec  # torch: see check_policy

        if not known_spec(name):
            raise NotFound(f"{where}: unknown drafter {name!r}; known kinds: {', '.join(drafter_kinds())} or a shipped zoo name")
        out: dict[str, Any] = {"name": name}
        if "target" in args:
            out["target"] = _str(where, "target", args["target"])
        device = out["device"] = _device(where, args.get("device", "cpu"))
        out["dtype"] = _dtype(where, args.get("dtype", "auto"))
        if "num_replicas" in args:
            out["num_replicas"] = _int(where, "num_replicas", args["num_replicas"], 1)
        out["ray_actor_options"] = _actor_options(where, args.get("ray_actor_options", {"num_cpus": 0.5, "num_gpus": 0}), device)
        if "max_ongoing_requests" in args:
            out["max_ongoing_requests"] = _int(where, "max_ongoing_requests", args["max_ongoing_requests"], 1)
        if args.get("torch_threads") is not None:
            out["torch_threads"] = _int(where, "torch_threads", args["torch_threads"], 1)
        if args.get("model_store") is not None:
            out["model_store"] = _str(where, "model_store", args["model_store"])
        if "learn_shared" in args:
            if not isinstance(args["learn_shared"], bool):
                raise InvalidArgument(f"{where}: learn_shared must be true or false, got {args['learn_shared']!r}")
            out["learn_shared"] = args["learn_shared"]
        if "refresh_s" in args:
            out["refresh_s"] = _float(where, "refresh_s", args["refresh_s"], 0.0)
        if "max_tenants" in args:
            out["max_tenants"] = _int(where, "max_tenants", args["max_tenants"], 1)
        return cls(**out)


# -- Serve config files -----------------------------------------------------------------------------------
def drafter_app_name(drafter: str) -> str:
    """The application name of a drafter: ``drafter-code``; spec characters Serve would not take
    in a name (``:`` ``/``) become ``-`` (``eagle:/srv/heads/code`` -> ``drafter-eagle-srv-heads-code``),
    and a name over 100 characters (a long head path) keeps its tail and a hash of the whole spec."""
    name = "drafter-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", drafter).strip("-")
    if len(name) <= 100:
        return name
    import hashlib

    digest = hashlib.sha256(drafter.encode()).hexdigest()[:10]
    return f"drafter-{digest}-{name[-(100 - 19):].lstrip('-.')}"


# Kinds of the white-box heads (specpool/drafters/eagle.py), by name: the config is written without
# loading a drafter.
WHITE_BOX_KINDS = ("eagle", "eagle-tree", "eagle-alt", "eagle-int8", "eagle-alt-int8")
# Whether `specpool serve` without --config has the target host the pool's white-box arms (see
# default_serve_config); measured in bench/results/served-hosted/.
DEFAULT_HOST_WHITE_BOX = True


def is_white_box_spec(name: str) -> bool:
    """Whether drafter spec ``name`` is a white-box head, alone or behind prompt lookup
    (``eagle:general``, ``lookup:eagle:code``, ``eagle-tree:/srv/heads/x``)."""
    while name.startswith("lookup:"):
        name = name[len("lookup:"):]
    return name.partition(":")[0] in WHITE_BOX_KINDS


def target_threads_for(cores: int) -> int:
    """The target's torch threads in the default config: every core.

    The router, the drafters (one thread each) and Serve's proxy run beside the target's forwards,
    so this once left them a core (cores - 1). With the white-box heads drafting (a few ms a round)
    the target is the bottleneck, and a batched verify gains most from a second thread: on a 2-core
    AMD EPYC a verify forward of 8 sessions' 6-token rounds over ~250 cached tokens took 267 ms at 1
    thread against 170 ms at 2 (one session: 55 against 45 ms). `bench-served` with the default pool
    and policy, 6 dev prompts, two runs each (bench/results/served-default-config/): 8 sessions 35.0
    and 35.3 tokens/s at 2 threads against 28.0 and 30.3 at 1; one session 0.751 and 0.734 of
    embedded against 0.748 and 0.762. (Before the heads, with one thread team per replica not yet
    enforced, 1 thread measured faster: 84 against 99 ms a verify forward, one session.)
    """
    return max(1, cores)


def default_serve_config(
    pool: list[str],
    redis_url: str = DEFAULT_REDIS_URL,
    grpc_port: int = DEFAULT_GRPC_PORT,
    http_port: int = DEFAULT_HTTP_PORT,
    policy: str = DEFAULT_POLICY,
    k: int = DEFAULT_K,
    cores: int | None = None,
    feature_dtype: str = "float16",
    host_white_box: bool | None = None,
    load_gate: bool = True,
) -> dict:
    """The Serve config `specpool serve` runs without --config: the target and one application per
    drafter of ``pool`` on this machine's CPUs, the router as the gRPC ingress. Same shape as
    k8s/rayservice.yaml's serveConfigV2 (print it with `specpool serve --print-config`).
    ``host_white_box``: the target hosts the pool's white-box arms (``is_white_box_spec``) and drafts
    with them in its verify call, instead of a drafter application each (None: DEFAULT_HOST_WHITE_BOX);
    ``load_gate``: its batches of several sessions draft only where that has measured faster
    (``TargetArgs.load_gate``)."""
    cores = cores or os.cpu_count() or 1
    host = DEFAULT_HOST_WHITE_BOX if host_white_box is None else host_white_box
    hosted = [name for name in pool if host and is_white_box_spec(name)]
    drafters = [
        {
            "name": drafter_app_name(name),
            "route_prefix": None,
            "import_path": DRAFTER_IMPORT_PATH,
            "logging_config": dict(MODEL_APP_LOGGING),
            "args": {"name": name, "target": DEFAULT_TARGET, "device": "cpu", "num_replicas": 1,
                     "ray_actor_options": {"num_cpus": 0.5 if name.startswith("ngram") else 1, "num_gpus": 0},
                     "torch_threads": 1},
        }
        for name in pool if name not in hosted
    ]
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "grpc_options": {"port": grpc_port, "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS)},
        "applications": [
            {
                "name": "router",
                "route_prefix": "/",
                "import_path": ROUTER_IMPORT_PATH,
                "args": {"redis_url": redis_url, "policy": policy, "k": k, "target_app": "target",
                         "drafter_apps": {name: "target" if name in hosted else drafter_app_name(name) for name in pool},
                         "num_replicas": 1, "ray_actor_options": {"num_cpus": 1, "num_gpus": 0}},
            },
            {
                "name": "target",
                "route_prefix": None,
                "import_path": TARGET_IMPORT_PATH,
                "logging_config": dict(MODEL_APP_LOGGING),
                "args": {"model": DEFAULT_TARGET, "device": "cpu", "dtype": "auto", "cache_capacity": 64,
                         "max_batch_size": 8, "batch_wait_timeout_s": 0.05, "num_replicas": 1,
                         "ray_actor_options": {"num_cpus": cores, "num_gpus": 0},
                         "torch_threads": target_threads_for(cores),
                         **({"feature_dtype": feature_dtype} if feature_dtype != "float16" else {}),
                         **({"hosted_drafters": hosted} if hosted else {}),
                         **({} if load_gate or not hosted else {"load_gate": False})},
            },
            *drafters,
        ],
    }


@dataclass(frozen=True)
class ServeApp:
    name: str
    route_prefix: str | None
    import_path: str
    args: dict
    logging_config: dict | None = None  # Serve's per-application LoggingConfig; None: Serve's default


@dataclass(frozen=True)
class ServePlan:
    """A Serve config reduced to what `specpool serve` deploys, in deployment order (the router
    last: its replicas look up the other applications when they start)."""

    apps: tuple[ServeApp, ...]
    grpc_port: int
    grpc_servicer_functions: tuple[str, ...]
    http_host: str
    http_port: int
    proxy_location: str

    @property
    def router(self) -> ServeApp:
        return next(app for app in self.apps if app.import_path == ROUTER_IMPORT_PATH)

    def cpus_wanted(self) -> float:
        total = 0.0
        for app in self.apps:
            options = app.args.get("ray_actor_options") or {"num_cpus": 1}
            total += float(options.get("num_cpus", 1)) * int(app.args.get("num_replicas", 1))
        return total

    def gpus_wanted(self) -> float:
        return sum(float((app.args.get("ray_actor_options") or {}).get("num_gpus", 0)) * int(app.args.get("num_replicas", 1))
                   for app in self.apps)


def plan_from_config(config: Any, source: str = "the Serve config") -> ServePlan:
    """Check a Serve config (the serveConfigV2 format) the way `specpool serve` needs it: exactly one
    router application, its target and drafter applications present, every builder's args valid."""
    if not isinstance(config, Mapping):
        raise InvalidArgument(f"{source}: expected a mapping with 'applications', got {type(config).__name__}")
    apps_raw = config.get("applications")
    if not isinstance(apps_raw, list) or not apps_raw:
        raise InvalidArgument(f"{source}: 'applications' must be a non-empty list")
    apps: list[ServeApp] = []
    for i, raw in enumerate(apps_raw):
        if not isinstance(raw, Mapping):
            raise InvalidArgument(f"{source}: applications[{i}] must be a mapping")
        name = raw.get("name")
        if not isinstance(name, str) or not _APP_NAME.match(name):
            raise InvalidArgument(f"{source}: applications[{i}] needs a name (letters, digits, _ . -), got {name!r}")
        import_path = raw.get("import_path")
        if import_path not in (ROUTER_IMPORT_PATH, TARGET_IMPORT_PATH, DRAFTER_IMPORT_PATH):
            raise InvalidArgument(f"{source}: application {name!r}: import_path must be one of {ROUTER_IMPORT_PATH}, "
                                  f"{TARGET_IMPORT_PATH}, {DRAFTER_IMPORT_PATH}; got {import_path!r}")
        args = dict(raw.get("args") or {})
        route = raw.get("route_prefix", "/" if import_path == ROUTER_IMPORT_PATH else None)
        apps.append(ServeApp(name, route, import_path, args, _logging_config(f"{source}: application {name!r}", raw.get("logging_config"))))
    names = [a.name for a in apps]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"{source}: application names repeat: {names}")
    routers = [a for a in apps if a.import_path == ROUTER_IMPORT_PATH]
    if len(routers) != 1:
        raise InvalidArgument(f"{source}: exactly one router application ({ROUTER_IMPORT_PATH}) is needed, found {len(routers)}")
    exposed = [a.name for a in apps if a.route_prefix is not None]
    if exposed != [routers[0].name]:
        raise InvalidArgument(f"{source}: only the router may have a route_prefix (the gRPC proxy then needs no "
                              f"'application' metadata); these have one: {exposed}")
    router = RouterArgs.parse(routers[0].args)
    by_name = {a.name: a for a in apps}
    target = by_name.get(router.target_app)
    if target is None or target.import_path != TARGET_IMPORT_PATH:
        raise InvalidArgument(f"{source}: the router's target_app {router.target_app!r} is not a {TARGET_IMPORT_PATH} application")
    hosted = TargetArgs.parse(target.args).hosted_drafters
    for drafter, app_name in router.drafter_apps:
        if app_name == router.target_app:  # hosted by the target (specpool/router/hosted.py)
            if drafter not in hosted:
                raise InvalidArgument(f"{source}: drafter_apps[{drafter!r}] is the target application {app_name!r}, but its "
                                      f"hosted_drafters do not include {drafter!r} (they are: {list(hosted)})")
            if router.feedback:
                raise InvalidArgument(f"{source}: drafter {drafter!r} is hosted by the target, which serves its shipped weights and "
                                      "sends no features with feedback records; with feedback: true give it a drafter application")
            continue
        app = by_name.get(app_name)
        if app is None or app.import_path != DRAFTER_IMPORT_PATH:
            raise InvalidArgument(f"{source}: drafter_apps[{drafter!r}] = {app_name!r} is not a {DRAFTER_IMPORT_PATH} application")
        parsed = DrafterArgs.parse(app.args)
        if parsed.name != drafter:
            raise InvalidArgument(f"{source}: application {app_name!r} serves drafter {parsed.name!r}, but the router calls it {drafter!r}")
    grpc_options = config.get("grpc_options") or {}
    http_options = config.get("http_options") or {}
    port = grpc_options.get("port", DEFAULT_GRPC_PORT)
    _int(source, "grpc_options.port", port, 1, 65535)
    functions = tuple(grpc_options.get("grpc_servicer_functions") or GRPC_SERVICER_FUNCTIONS)
    if GRPC_SERVICER_FUNCTIONS[0] not in functions:
        raise InvalidArgument(f"{source}: grpc_options.grpc_servicer_functions must include {GRPC_SERVICER_FUNCTIONS[0]}")
    http_port = http_options.get("port", DEFAULT_HTTP_PORT)
    _int(source, "http_options.port", http_port, 1, 65535)
    order = [a for a in apps if a.import_path != ROUTER_IMPORT_PATH] + routers
    return ServePlan(tuple(order), port, functions, str(http_options.get("host", "127.0.0.1")), http_port,
                     str(config.get("proxy_location", "HeadOnly")))


def _logging_config(where: str, value: Any) -> dict | None:
    """An application's ``logging_config``, checked by Serve's own model (unknown keys, bad levels)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{where}: logging_config must be a mapping, got {type(value).__name__}")
    from ray.serve.schema import LoggingConfig

    try:
        LoggingConfig(**value)
    except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError, or a TypeError
        # pydantic: "1 validation error ...", then the field, then the reason [type=...]
        lines = [line.strip() for line in str(exc).splitlines()[1:3] if line.strip()]
        reason = ": ".join(lines).split(" [type=", 1)[0] if lines else str(exc)
        raise InvalidArgument(f"{where}: invalid logging_config ({reason})") from None
    return dict(value)


def load_serve_config(path: Path) -> dict:
    """A Serve config file: YAML (or JSON) with 'applications'; a KubeRay RayService manifest
    works too (its spec.serveConfigV2 is used)."""
    import yaml

    if not path.is_file():
        raise NotFound(f"config file {path} does not exist")
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    for doc in docs:
        if isinstance(doc, Mapping) and doc.get("kind") == "RayService":
            text = (doc.get("spec") or {}).get("serveConfigV2")
            if not isinstance(text, str):
                raise InvalidArgument(f"{path}: the RayService has no spec.serveConfigV2")
            return yaml.safe_load(text)
    if len(docs) != 1 or not isinstance(docs[0], Mapping):
        raise InvalidArgument(f"{path}: expected one Serve config (a mapping with 'applications')")
    return dict(docs[0])
