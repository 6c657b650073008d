"""The served-mode commands of ``specpool``: ``serve``, ``client generate`` and ``bench-served``.

Kept apart from specpool/cli/main.py, which only registers them (``add_served_commands``) and
dispatches (``run_served_command``). Same conventions: one ``specpool: error: ...`` line; exit
status 2 for bad input, 1 when the server failed or could not be reached.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

from specpool.core.defaults import DEFAULT_DRAFTER, DEFAULT_POLICY, MAX_DRAFT_LENGTH
from specpool.cli.bench_loader import add_bench_command, load_bench
from specpool.core.errors import InvalidArgument, SpecpoolError, check

EXIT_SERVER = 1
INPUT_CODES = ("INVALID_ARGUMENT", "NOT_FOUND")
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def add_served_commands(commands) -> None:
    """Add ``serve``, ``client`` and ``bench-served`` to the ``specpool`` subcommands."""
    from specpool.services.serve_config import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT

    serve = commands.add_parser("serve", help="serve the gRPC API on a local Ray Serve (served mode)")
    serve.add_argument("--config", default=None,
                       help="a Serve config file (YAML, the serveConfigV2 format; a RayService manifest works too); "
                            "default: the target and every shipped drafter on this machine")
    serve.add_argument("--redis-url", default=None,
                       help="Redis for session state (default: the config's, else redis://127.0.0.1:6379/0)")
    serve.add_argument("--port", type=int, default=None, help=f"gRPC port (default: the config's, else {DEFAULT_GRPC_PORT})")
    serve.add_argument("--http-port", type=int, default=None,
                       help=f"port of the OpenAI-compatible HTTP API, http://127.0.0.1:PORT/v1 (default: the config's, else {DEFAULT_HTTP_PORT})")
    serve.add_argument("--no-http", action="store_true", help="serve gRPC only: the HTTP API answers 404")
    serve.add_argument("--api-keys", default=None, metavar="FILE",
                       help="API keys -> tenants (SHA-256 hashes; `specpool keys create`): every gRPC and HTTP request then needs "
                            "'authorization: Bearer KEY' (default: the config's api_keys_file, else $SPECPOOL_API_KEYS, else no keys)")
    serve.add_argument("--quotas", default=None, metavar="FILE",
                       help="per-tenant quotas (max_concurrent, tokens_per_minute, max_prompt_bytes, max_new_tokens; "
                            "specpool/services/admission.py), enforced over every router replica in Redis (default: none)")
    serve.add_argument("--tls-cert", default=None, metavar="PEM",
                       help="serve gRPC over TLS with this certificate chain (with --tls-key): a TLS front on the gRPC port, "
                            "Serve's plaintext proxy behind it on a loopback port; the files are re-read when they change")
    serve.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key (with --tls-cert)")
    serve.add_argument("--tls-client-ca", default=None, metavar="PEM",
                       help="with --tls-cert: require client certificates signed by this CA (mutual TLS)")
    serve.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                       help=f"Prometheus metrics port, http://127.0.0.1:PORT/metrics (default {DEFAULT_METRICS_PORT}; 0 = none)")
    serve.add_argument("--pool", default=None, help="without --config: comma-separated drafters to serve (default: every shipped white-box head behind prompt lookup, the general one first, and ngram)")
    serve.add_argument("--policy", default=None,
                       help=f"without --config: the policy of a request that names none (default: without --pool, "
                            f"fixed:{DEFAULT_DRAFTER}, the fastest measured, over a pool a request may choose from with "
                            f"its own policy; with --pool, {DEFAULT_POLICY})")
    serve.add_argument("-k", type=int, default=None, help="without --config: the default draft length (default 5)")
    serve.add_argument("--feature-dtype", default=None, choices=("float16", "bfloat16"),
                       help="without --config: how the target's features travel to white-box drafters (eagle:...), "
                            "2 bytes a value (default float16)")
    serve.add_argument("--host-heads", default=None, action=argparse.BooleanOptionalAction,
                       help="without --config: the target deployment hosts the pool's white-box heads (eagle:..., "
                            "lookup:eagle:...) and drafts with them inside its verify call, one call a round "
                            "(default); --no-host-heads: a drafter deployment per head, fed the features over the wire "
                            "(what online learning of a head needs)")
    serve.add_argument("--load-gate", default=None, action=argparse.BooleanOptionalAction,
                       help="without --config: with hosted heads, a verify batch of several sessions drafts only where "
                            "drafting has measured faster than plain batched decoding at that batch size (default); "
                            "--no-load-gate: every batch drafts")
    serve.add_argument("--print-config", action="store_true", help="print the Serve config that would run, and exit")

    client = commands.add_parser("client", help="talk to a running `specpool serve` (or a cluster) over gRPC")
    client_commands = client.add_subparsers(dest="client_command", required=True, parser_class=commands._parser_class)
    gen = client_commands.add_parser("generate", help="generate text for one prompt on the server")
    gen.add_argument("prompt")
    gen.add_argument("--address", default=f"127.0.0.1:{DEFAULT_GRPC_PORT}", help="HOST:PORT of the server (default 127.0.0.1:50051)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are accepted (GenerateStream)")
    gen.add_argument("--json", action="store_true", help="print JSON: one object (with --stream: one per message)")
    gen.add_argument("--policy", default="", help="drafter-choice policy (default: the server's), e.g. metasd-ucb, fixed:code, thompson+warm")
    gen.add_argument("--session", default="", help="session to continue (default: a new one; its id is printed)")
    gen.add_argument("--tenant", default="", help="tenant the request is accounted to (default: the API key's, else default)")
    gen.add_argument("--api-key", default=None,
                     help="API key, sent as 'authorization: Bearer KEY' (default: $SPECPOOL_API_KEY, if set)")
    gen.add_argument("-k", type=int, default=0, help=f"draft length 1..{MAX_DRAFT_LENGTH} (default: the server's)")
    gen.add_argument("--max-new-tokens", type=int, default=0, help="new tokens (default: the server's, 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable); the text ends right after it")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds; past it the server stops the request")

    keys = commands.add_parser("keys", help="API keys of a served instance: each maps to a tenant (the file keeps hashes only)")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, parser_class=commands._parser_class)
    create = key_commands.add_parser("create", help="make a key for a tenant, add its hash to the key file, print the key once")
    create.add_argument("--tenant", required=True, help="the tenant every request with this key runs as")
    create.add_argument("--file", required=True, help="the key file (created if missing); give it to `specpool serve --api-keys`")
    create.add_argument("--admin", action="store_true", help="the key may act for any tenant (operations that span tenants)")
    create.add_argument("--name", default="", help="a label for people (which client holds the key)")
    listing = key_commands.add_parser("list", help="the tenants, roles and labels of a key file (no keys: they are not stored)")
    listing.add_argument("--file", required=True)

    # Its options come from bench/served.py of the checkout (specpool/cli/bench_loader.py).
    add_bench_command(commands, "bench-served", command="bench-served",
                      help="benchmark served vs embedded: tokens/s, concurrency, latency", module="served",
                      add_arguments=lambda served, parser: served.add_bench_served_arguments(parser))


def run_served_command(args: argparse.Namespace, settings) -> int | None:
    """Run ``args`` if it is a served-mode command; None otherwise."""
    if args.command == "serve":
        return cmd_serve(args, settings)
    if args.command == "client" and args.client_command == "generate":
        return cmd_client_generate(args)
    if args.command == "keys":
        return cmd_keys(args)
    if args.command == "bench-served":
        return load_bench("served", "bench-served").run_bench_served(args, settings)
    return None


# -- specpool serve -----------------------------------------------------------------------------------
def serve_config_from_args(args: argparse.Namespace) -> tuple[dict, str]:
    """The Serve config a `specpool serve` command line means, and where it came from."""
    from specpool.services.serve_config import DEFAULT_GRPC_PORT, DEFAULT_REDIS_URL, default_serve_config, load_serve_config

    if args.config is not None:
        for flag, value in (("--pool", args.pool), ("--policy", args.policy), ("-k", args.k),
                            ("--feature-dtype", getattr(args, "feature_dtype", None)),
                            ("--host-heads/--no-host-heads", getattr(args, "host_heads", None)),
                            ("--load-gate/--no-load-gate", getattr(args, "load_gate", None))):
            if value is not None:
                raise InvalidArgument(f"{flag} is for the default config; with --config, set it in {args.config}")
        config, source = load_serve_config(Path(args.config)), args.config
    else:
        from specpool.services.engine import default_policy, default_pool

        pool = [p.strip() for p in args.pool.split(",") if p.strip()] if args.pool is not None else default_pool()
        check(bool(pool), "--pool is empty; give drafter names such as ngram,code,math")
        check(len(set(pool)) == len(pool), f"--pool names a drafter twice: {args.pool}")
        policy = args.policy or default_policy(pool_named=args.pool is not None)
        config = default_serve_config(pool, DEFAULT_REDIS_URL, DEFAULT_GRPC_PORT, policy=policy,
                                      k=args.k if args.k is not None else 5,
                                      feature_dtype=getattr(args, "feature_dtype", None) or "float16",
                                      host_white_box=getattr(args, "host_heads", None),
                                      load_gate=getattr(args, "load_gate", None) is not False)
        source = "the default config"
    if args.port is not None:
        check(1 <= args.port <= 65535, f"--port must be in 1..65535, got {args.port}")
        config.setdefault("grpc_options", {})["port"] = args.port
    if getattr(args, "http_port", None) is not None:
        check(1 <= args.http_port <= 65535, f"--http-port must be in 1..65535, got {args.http_port}")
        config.setdefault("http_options", {})["port"] = args.http_port
    for app in config.get("applications") or []:
        if isinstance(app, dict) and app.get("import_path") == "specpool.services.serve_app:build_router_app":
            router_args = app.setdefault("args", {})
            if args.redis_url is not None:
                router_args.pop("redis_url_env", None)  # --redis-url wins over the config's variable
                router_args["redis_url"] = args.redis_url
            if getattr(args, "no_http", False):
                router_args["http_api"] = False
            if getattr(args, "api_keys", None) is not None:
                router_args["api_keys_file"] = str(Path(args.api_keys).resolve())
            if getattr(args, "quotas", None) is not None:
                router_args["quotas_file"] = str(Path(args.quotas).resolve())
    return config, source


def cmd_serve(args: argparse.Namespace, settings) -> int:
    from specpool.services.serve_config import plan_from_config

    config, source = serve_config_from_args(args)
    plan = plan_from_config(config, source)  # every builder's args checked before Ray starts
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config, sort_keys=False), end="")
        return 0
    check(0 <= args.metrics_port <= 65535, f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    from specpool.router.session_store import redact_url
    from specpool.services.local_serve import check_port_free, start_local
    from specpool.services.serve_config import RouterArgs

    router = RouterArgs.parse(plan.router.args)
    public_port = plan.grpc_port
    if args.tls_cert or args.tls_key or args.tls_client_ca:
        from specpool.services.tls_front import free_port, server_credentials

        check(bool(args.tls_cert and args.tls_key), "--tls-cert and --tls-key go together")
        server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)  # bad files: one line, before Ray starts
        check_port_free(public_port, "gRPC (TLS)")
        # Serve's proxy (plaintext) moves to a free port; only the TLS front listens on the public one.
        plan = dataclasses.replace(plan, grpc_port=free_port())

    def say(message: str) -> None:
        print(f"specpool: {message}", file=sys.stderr, flush=True)

    def on_term(signum, frame):  # `kill` (a pod's termination) stops as cleanly as Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    local = front = None
    try:
        local = start_local(plan, metrics_port=args.metrics_port or None, progress=say)
        if args.tls_cert:
            from specpool.services.tls_front import start_tls_front

            front = start_tls_front(f"0.0.0.0:{public_port}", local.address, args.tls_cert, args.tls_key, args.tls_client_ca)
        # ray.init installed its own SIGTERM handler (it exits at once, with a traceback from
        # wherever the main thread was): ours again, so SIGTERM drains like Ctrl-C.
        signal.signal(signal.SIGTERM, on_term)
        if front is not None:
            mutual = ", client certificates required" if args.tls_client_ca else ""
            print(f"specpool: serving specpool.v1.SpecPool on 0.0.0.0:{public_port} (gRPC over TLS{mutual}; health checking "
                  f"and reflection too), Serve's plaintext proxy behind it on {local.address}", flush=True)
        else:
            print(f"specpool: serving specpool.v1.SpecPool on {local.address} (gRPC; health checking and reflection too)", flush=True)
        if local.http_url:
            print(f"  OpenAI-compatible HTTP API: {local.http_url} (chat/completions, completions, models; /health)", flush=True)
        keys = "API keys from " + (router.api_keys_file or "$SPECPOOL_API_KEYS") if _keys_on(router) else "no API keys (open)"
        print(f"  {keys}", flush=True)
        print(f"  drafters {', '.join(router.pool)}; default policy {router.policy}, k {router.k}; "
              f"session state in {redact_url(router.resolved_redis_url())}", flush=True)
        if local.metrics_url:
            print(f"  metrics (Prometheus): {local.metrics_url}", flush=True)
        print(f"  try: specpool client generate \"Hello\" --address {local.address}    (Ctrl-C to stop)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        # Serve's proxies stop taking requests; each replica lets its running requests finish for
        # up to its graceful_shutdown_timeout_s (Serve's default, 20 s), then cancels them, which
        # frees their sessions' caches (Orchestrator.run). A second SIGTERM meanwhile is ignored.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        say("shutting down: new requests are refused, running ones may finish (up to 20 s) ...")
    finally:
        if front is not None:
            front.stop(20.0)  # its calls in flight end with the proxy's (Serve's grace is 20 s too)
        if local is not None:
            local.shutdown()
        signal.signal(signal.SIGTERM, previous)
    say("stopped")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from specpool.services.auth import add_key, load_keys_file

    if args.keys_command == "create":
        key = add_key(args.file, args.tenant, "admin" if args.admin else "user", args.name)
        print(key)
        print(f"specpool: key for tenant {args.tenant!r}{' (admin)' if args.admin else ''} added to {args.file}; "
              "it is shown only now (the file keeps its SHA-256)", file=sys.stderr)
        return 0
    for entry in load_keys_file(args.file).entries:
        print(f"{entry.tenant}\t{entry.role}\t{entry.name or '-'}\tsha256:{entry.sha256[:12]}...")
    return 0


def _keys_on(router) -> bool:
    from specpool.services.auth import load_api_keys

    return load_api_keys(router.api_keys_file).enabled


# -- specpool client generate -------------------------------------------------------------------------
def _summary(stats, finish: str, session: str) -> str:
    tps = stats.new_tokens / stats.wall_s if stats.wall_s > 0 else 0.0
    return (f"[{stats.new_tokens} new tokens, {stats.rounds} rounds, mean accepted length "
            f"{stats.mean_accepted_length:.2f}, {tps:.1f} tokens/s, finish: {finish}, session {session}]")


def cmd_client_generate(args: argparse.Namespace) -> int:
    from specpool.services.client import SpecPoolClient

    check(bool(args.prompt.strip()), "the prompt is empty")
    check(_ADDRESS.match(args.address) is not None, f"--address must be HOST:PORT, got {args.address!r}")
    check(args.timeout is None or args.timeout > 0, f"--timeout must be > 0 seconds, got {args.timeout}")
    check(args.max_new_tokens >= 0, f"--max-new-tokens must be >= 0 (0 = the server's default), got {args.max_new_tokens}")
    check(0 <= args.k <= MAX_DRAFT_LENGTH, f"-k must be in 1..{MAX_DRAFT_LENGTH} (0 = the server's default), got {args.k}")
    check(args.top_k >= 0, f"--top-k must be >= 0, got {args.top_k}")
    fields = dict(raw=args.raw, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, stop=args.stop, policy=args.policy, k=args.k,
                  session_id=args.session, tenant=args.tenant, timeout=args.timeout)
    api_key = args.api_key if args.api_key is not None else os.environ.get("SPECPOOL_API_KEY") or None
    try:
        with SpecPoolClient(args.address, api_key=api_key) as client:
            if not args.stream:
                answer = client.generate(args.prompt, **fields)
                if args.json:
                    print(json.dumps(answer.as_dict()))
                else:
                    print(answer.text)
                    print(_summary(answer.stats, answer.finish_reason, answer.session_id))
                return 0
            last = None
            for chunk in client.generate_stream(args.prompt, **fields):
                if args.json:
                    print(json.dumps(chunk.as_dict()), flush=True)
                else:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                last = chunk
            if not args.json and last is not None and last.stats is not None:
                print("\n" + _summary(last.stats, last.finish_reason or "unspecified", last.session_id))
            return 0
    except SpecpoolError as exc:
        if getattr(exc, "code", "") in INPUT_CODES:
            raise
        print(f"specpool: error: {exc.code}: {exc}", file=sys.stderr)
        return EXIT_SERVER
