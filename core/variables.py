"""The names of trialstream's environment variables, apart from the settings model (core.settings) so that
what only needs a name loads no pydantic: `trialstream worker` hands over to the worker runtime with these
alone; and the one guard of the environment that holds them."""

import ctypes
import sys

_PR_SET_DUMPABLE = 4

PREFIX = "TRIALSTREAM_"
REDIS_URL_ENV = f"{PREFIX}REDIS_URL"
EXPERIMENTS_DIR_ENV = f"{PREFIX}EXPERIMENTS_DIR"  # the setting `experiments_dir`, named where it cannot be used
MANAGER_TOKEN_ENV = f"{PREFIX}MANAGER_TOKEN"  # the setting `manager_token`, named where a message tells the user
TLS_CA_ENV = f"{PREFIX}REDIS_TLS_CA_FILE"  # the setting `redis_tls_ca_file`, named where a wrong CA is reported


def hide_environment() -> None:
    """Make this process's /proc entries (its environment: the Redis password, the manager's token) unreadable to
    other processes of its user, local trials above all (Linux only; exec resets it). Called first thing by every
    entry point, so that the window in which a trial could read them is the interpreter's start alone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
