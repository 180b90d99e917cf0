"""`trialstream manager`: the API, NNI's web UI, the projector and the runners, in one process."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.connections import connect
from core.logging_setup import configure_logging
from core.redis_urls import redact_url
from core.settings import Settings
from core.variables import MANAGER_TOKEN_ENV as TOKEN_ENV
from manager.cli.access import required_url
from manager.local_token import make_token
from manager.runner import RunnerError

if TYPE_CHECKING:
    from manager.host import OnExit

MAX_PORT = 65535
SWITCH_INTERVAL_S = 0.001
"""How long a thread holds the GIL while another waits for it (Python's default: 5 ms). The manager's work
is latency-bound: a runner reacting to a trial's end takes the GIL back after each Redis reply, and under
web UIs polling flat out it would wait up to 5 ms each time behind a handler thread (bench/api.py)."""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    manager = commands.add_parser(
        "manager",
        help="serve the API and NNI's web UI, project, and run experiments submitted to it",
        description=f"Every request carries its token (${TOKEN_ENV} or --token-file) as `Authorization: Bearer "
        "<token>`, or a browser's cookie from /login?token=...; given none, on loopback it makes one for this run "
        "and writes it where only its user reads it (the CLI of that user finds it). With --no-token (loopback "
        "only) it answers any user of this machine, and only requests whose Host is a loopback name (localhost, "
        "127.0.0.1, [::1]) or an --allowed-host; with or without a token, a request whose Origin is another "
        "site's is refused.",
    )
    manager.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    manager.add_argument("--port", type=int, default=8080, help="port (default: 8080, as nnictl's)")
    manager.add_argument("--url-prefix", default="", help="serve everything under /PREFIX, as NNI's --url-prefix")
    manager.add_argument("--token-file", type=Path, help=f"a file holding the bearer token (else ${TOKEN_ENV})")
    manager.add_argument(
        "--no-token",
        action="store_true",
        help="on loopback, take requests without a token: any user of this machine could then run commands as you",
    )
    manager.add_argument("--cors-origin", action="append", default=[], help="allow this origin (CORS is off without)")
    manager.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="answer requests for this host name too (a reverse proxy's), and pages of it",
    )
    manager.add_argument(
        "--nnictl-registry",
        action="store_true",
        help="list the experiments it runs in ~/nni-experiments/.experiment, so nnictl sees them",
    )
    manager.add_argument(
        "--on-exit",
        choices=("detach", "stop"),
        help="on SIGTERM: leave its experiments running, resumed at the next start (detach, the default), "
        "or stop them as nnictl stop does NNI's (stop, the default with --nnictl-registry)",
    )
    manager.add_argument("--log-format", choices=("text", "json"), default="text", help="json: one object per line")
    manager.set_defaults(handler=_manager)


def _manager(args: argparse.Namespace, settings: Settings) -> int:
    # The server's modules (FastAPI, uvicorn, the API) load here, not with the command line: every other
    # command, and every worker (`trialstream worker`), starts half a second sooner without them.
    import uvicorn

    from manager.api.app import ApiOptions, allowed_host_problem, build_api, guarded, nnictl_api, served_under
    from manager.api.webui import url_prefix_problem
    from manager.host import ManagerHost
    from manager.nnictl import NnictlBridge

    configure_logging(args.log_format)
    if not 0 <= args.port <= MAX_PORT:  # a socket takes it modulo 2**16: 99999 would be announced, 34463 served
        raise RunnerError(f"--port {args.port}: give a port from 1 to {MAX_PORT} (0: any free one)")
    token = _token(args.token_file, settings)
    if token is not None and args.no_token:
        raise RunnerError(f"--no-token, and a token given (${TOKEN_ENV} or --token-file): choose one")
    if token is None and not _is_loopback(args.host):
        raise RunnerError(
            f"--host {args.host} is not a loopback address: the API would be open to the network. "
            f"Give it a token (${TOKEN_ENV}, or --token-file FILE), or bind 127.0.0.1"
        )
    if token is None and "*" in args.cors_origin:
        raise RunnerError(
            "--cors-origin *: every site's pages could send this manager requests; give it a token "
            f"(${TOKEN_ENV}, or --token-file FILE), or name the origins"
        )
    url = required_url(settings)
    prefix = args.url_prefix.strip("/")
    prefix_problem = url_prefix_problem(prefix) if prefix else None
    if prefix_problem is not None:
        raise RunnerError(f"--url-prefix {prefix}: {prefix_problem}; choose another")
    for name in args.allowed_host:
        name_problem = allowed_host_problem(name)
        if name_problem is not None:
            raise RunnerError(f"--allowed-host {name}: expected {name_problem}")
    on_exit: OnExit = args.on_exit or ("stop" if args.nnictl_registry else "detach")
    listener = _listening(args.host, args.port)
    port = listener.getsockname()[1]  # --port 0's free one
    host = ManagerHost(connect(url, options=settings.redis_options()), settings)
    token_file = None  # where the token this run made is kept
    if token is None and not args.no_token:
        token, token_file = make_token(port)
    options = ApiOptions(token=token, cors_origins=tuple(args.cors_origin), allowed_hosts=tuple(args.allowed_host))
    api = build_api(host, options)
    server = uvicorn.Server(
        uvicorn.Config(
            served_under(guarded(api, options), prefix),
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    )
    # nnictl's per-experiment ports (127.0.0.1 only) take no token: nnictl has no way to send one, so they
    # answer as a port with no token does, to loopback names (and --allowed-host ones) alone
    bridge = NnictlBridge(host, nnictl_api(host, options)) if args.nnictl_registry else None
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    host.start()
    log.info("manager on http://%s:%d/%s serving %s", args.host, port, prefix, redact_url(url))
    log.info("experiment timelines on http://%s:%d%s/timeline/", args.host, port, f"/{prefix}" if prefix else "")
    if token_file is not None:
        log.info(
            "its token, made for this run, is in %s: this user's CLI reads it there; a browser opens "
            "http://%s:%d/%slogin?token=<that token> once",
            token_file,
            args.host,
            port,
            f"{prefix}/" if prefix else "",
        )
    try:
        server.run([listener])  # returns on SIGTERM or Ctrl-C, which it then raises again: a clean stop, not an error
    except KeyboardInterrupt:
        pass
    finally:
        try:
            host.shutdown(on_exit)
        finally:  # nnictl's entries say STOPPED whatever shutdown met
            if bridge is not None:
                bridge.close()
            if token_file is not None:
                token_file.unlink(missing_ok=True)
        log.info("manager stopped (%s its experiments)", "stopped" if on_exit == "stop" else "detached from")
    return 0


def _token(token_file: Path | None, settings: Settings) -> str | None:
    if token_file is not None:
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except OSError as error:
            raise RunnerError(f"--token-file {token_file}: cannot read it ({error.strerror})") from None
        except UnicodeDecodeError:
            raise RunnerError(f"--token-file {token_file}: not UTF-8 text, so no token") from None
        if not token:
            raise RunnerError(f"--token-file {token_file} is empty")
        return token
    return settings.manager_token.get_secret_value() if settings.manager_token else None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in _addresses(host, None))


def _listening(host: str, port: int) -> socket.socket:
    """The manager's socket, bound before it starts experiments or says where it serves (uvicorn, left to bind,
    logs a port in use after that announcement). One socket, on `host`'s first address, as uvicorn binds one for
    its workers; an IPv6 one takes IPv6 alone, as asyncio's binding did."""
    family, kind, proto, _, address = _addresses(host, port)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        listener.bind(address)
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRINUSE:
            raise RunnerError(
                f"--port {port}: {host}:{port} is in use; stop what listens there, or choose another port"
            ) from None
        raise RunnerError(f"--host {host} --port {port}: cannot listen there ({error.strerror})") from None
    return listener


def _addresses(host: str, port: int | None) -> list[tuple[Any, ...]]:
    """The addresses `host` names for listening on; a name that resolves to none is the user's to fix."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise RunnerError(f"--host {host}: no such address ({error.strerror}); give an address of this host") from None


log = logging.getLogger(__name__)
