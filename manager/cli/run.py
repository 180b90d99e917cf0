"""`trialstream run|resume`: drive an experiment to its end, on a shared Redis or an embedded stack."""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Protocol

import redis
from rich.live import Live

from core import keys
from core.connections import connect, same_server
from core.redis_urls import redact_url
from core.settings import Settings
from manager.cli import interrupts, managed, render
from manager.cli.access import manager_client
from manager.config import ExperimentSpec, load_experiment_config, stored_experiment_spec
from manager.experiments import new_id, resolve_experiment
from manager.preflight import unserved
from manager.runner import ExperimentResult, ExperimentRunner, Progress, RunnerError
from manager.stack import EmbeddedStack, StackError, experiment_dir, experiments_root, live_url, new_experiment_dir
from manager.training_service import TrainingService

_SERVED_POLL_S = 0.1
_STOPPING = "stopping experiment {id}: its running trials are canceled (Ctrl-C again to quit at once)"
_INTERRUPTED = "interrupted; `trialstream resume {id}` continues experiment {id}"
_HOW_IT_STOPS = (
    "With a shared Redis it waits up to TRIALSTREAM_SERVED_WAIT_S (10 s) for a worker of the platform's queue and a "
    "projector to serve it; with --manager URL the manager runs it and this command follows it. Ctrl-C or "
    "SIGTERM stops the experiment: running trials are SYS_CANCELED, the experiment is STOPPED, and the exit "
    "status is 130 (143 for SIGTERM); a second Ctrl-C quits at once."
)


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = commands.add_parser("run", help="run an NNI v2 experiment YAML to completion", description=_HOW_IT_STOPS)
    run.add_argument("config", type=Path)
    run.add_argument("--json", action="store_true", help="print the result as one JSON object at the end")
    run.set_defaults(handler=_run)

    resume = commands.add_parser(
        "resume", help="continue an experiment from its log after its runner stopped", description=_HOW_IT_STOPS
    )
    resume.add_argument("experiment_id")
    resume.add_argument("--json", action="store_true", help="print the result as one JSON object at the end")
    resume.add_argument(
        "--imported",
        action="store_true",
        help="resume an imported experiment: its unfinished trials are first ended SYS_CANCELED",
    )
    resume.set_defaults(handler=_resume)


def _run(args: argparse.Namespace, settings: Settings) -> int:
    spec = load_experiment_config(args.config)
    if settings.manager_url is not None:
        manager = manager_client(settings)
        result = _drive(lambda show: managed.create(spec, manager, show, settings.manager_wait_s))
    elif settings.redis_url is not None:
        client, rq_connection = _shared(settings, spec.platform_names)
        result = _drive(
            lambda show: ExperimentRunner.create(spec, client, rq_connection, on_progress=show, settings=settings)
        )
    else:
        result = _run_embedded(spec, settings)
    _print_result(result, args.json)
    return 0


def _run_embedded(spec: ExperimentSpec, settings: Settings) -> ExperimentResult:
    """The experiment on a stack of its own, in a new directory; one refused before it was created (a host
    unreachable) leaves no directory behind, which would be listed, and taken for the newest experiment."""
    experiment_id = new_id(8)
    directory = new_experiment_dir(settings, experiment_id, spec.config.experiment_working_directory)
    recorded = True
    try:
        with EmbeddedStack(directory, settings) as stack:
            stack.services.serve(spec.platform_names, spec.config.trial_concurrency)
            try:
                with _explained(stack):
                    return _drive(
                        lambda show: ExperimentRunner.create(
                            spec,
                            stack.client,
                            stack.rq_connection,
                            experiment_id,
                            on_progress=_checked(stack, show),
                            settings=settings,
                        )
                    )
            except BaseException:
                with suppress(redis.RedisError):  # not known: its data is kept
                    recorded = bool(stack.client.exists(keys.events(experiment_id)))
                raise
    finally:
        if not recorded:
            shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def _explained(stack: EmbeddedStack) -> Iterator[None]:
    """The run's error said as the stack's failure, where it has one (a service it gave up starting again, Redis
    included): that is why the run ended, whatever the runner raised on its way out."""
    try:
        yield
    except BaseException as error:
        if stack.services.failure is not None:
            raise StackError(stack.services.failure) from error
        raise


def _checked(stack: EmbeddedStack, show: Callable[[Progress], None]) -> Callable[[Progress], None]:
    """`show`, after raising the StackError of a service the stack gave up starting again: the runner, which
    calls it every round, then stops the experiment as on any error, and the command says why."""

    def check_and_show(progress: Progress) -> None:
        stack.services.check()
        show(progress)

    return check_and_show


def _resume(args: argparse.Namespace, settings: Settings) -> int:
    """Continue an experiment whose runner stopped, from its log (see ExperimentRunner.resume)."""
    if settings.manager_url is not None:
        manager = manager_client(settings)
        result = _drive(
            lambda show: managed.resume(manager, args.experiment_id, args.imported, show, settings.manager_wait_s)
        )
    elif settings.redis_url is not None:
        reader = connect(settings.redis_url, options=settings.redis_options())
        experiment_id = resolve_experiment(reader, args.experiment_id)
        spec = _stored_spec(reader, same_server(reader, decode=False), experiment_id)
        client, rq_connection = _shared(settings, spec.platform_names)
        result = _drive(
            lambda show: ExperimentRunner.resume(
                client, rq_connection, experiment_id, show, settings=settings, allow_imported=args.imported
            )
        )
    else:
        directory = experiment_dir(experiments_root(settings), args.experiment_id)
        if live_url(directory) is not None:
            raise RunnerError(f"experiment {args.experiment_id} is still running (its Redis answers)")
        with EmbeddedStack(directory, settings) as stack:
            experiment_id = resolve_experiment(stack.client, args.experiment_id)
            spec = _stored_spec(stack.client, stack.rq_connection, experiment_id)
            stack.services.serve(spec.platform_names, spec.config.trial_concurrency)
            with _explained(stack):
                result = _drive(
                    lambda show: ExperimentRunner.resume(
                        stack.client,
                        stack.rq_connection,
                        experiment_id,
                        _checked(stack, show),
                        settings=settings,
                        allow_imported=args.imported,
                    )
                )
    _print_result(result, args.json)
    return 0


def _shared(settings: Settings, platforms: list[str]) -> tuple[redis.Redis, redis.Redis]:
    """Clients of the shared Redis, once a worker serves each platform (every listed one, for hybrid)."""
    url = settings.redis_url
    assert url is not None
    client = connect(url, options=settings.redis_options())
    rq_connection = same_server(client, decode=False)
    for platform in platforms:
        wait_until_served(client, rq_connection, platform, redact_url(url), settings.served_wait_s)
    return client, rq_connection


def wait_until_served(
    client: redis.Redis, rq_connection: redis.Redis, platform: str, url_hint: str, wait_s: float
) -> None:
    """Services started with the run may still be registering: give them `wait_s`, then fail clearly."""
    give_up = time.monotonic() + wait_s
    waiting = False
    while (missing := unserved(client, rq_connection, platform, url_hint)) is not None:
        if time.monotonic() >= give_up:
            raise RunnerError(f"{missing} (waited {wait_s:g} s)")
        if not waiting:
            render.note(f"waiting up to {wait_s:g} s for {url_hint} to be served: {missing}")
            waiting = True
        time.sleep(_SERVED_POLL_S)


def _stored_spec(client: redis.Redis, rq_connection: redis.Redis, experiment_id: str) -> ExperimentSpec:
    experiment = TrainingService(client, rq_connection, experiment_id).experiment_view()
    return stored_experiment_spec(experiment.config, experiment.working_directory)


class _Run(Protocol):
    """What `_drive` drives: a runner here, or an experiment a manager runs (manager/cli/managed.py)."""

    @property
    def experiment_id(self) -> str: ...

    def run(self) -> ExperimentResult: ...


def _drive(make_runner: Callable[[Callable[[Progress], None]], _Run]) -> ExperimentResult:
    """Run to the end with live progress; an interrupt stops the experiment cleanly (the runner's own
    unwinding) before it reaches `main`, which exits 130 or 143."""
    live = Live(console=render.err, refresh_per_second=8, transient=False)
    try:
        with live:
            runner = make_runner(lambda progress: live.update(render.progress_table(progress)))
            try:
                with interrupts.announced(_STOPPING.format(id=runner.experiment_id)):
                    return runner.run()
            except KeyboardInterrupt as stop:
                raise interrupts.explained(stop, _INTERRUPTED.format(id=runner.experiment_id)) from None
    finally:
        # Rich ends its last frame with a newline on a terminal only: elsewhere an error or note after it would
        # follow on the table's last line. No progress yet, no frame (get_renderable is ""): no line to end.
        if live.get_renderable() and not render.err.is_terminal:
            render.err.line()


def _print_result(result: ExperimentResult, as_json: bool) -> None:
    if as_json:
        print(result.to_json())
    else:
        render.print_trials(result.trials, title=f"experiment {result.experiment_id}")
