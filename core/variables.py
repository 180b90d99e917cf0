"""The names of trialstream's environment variables, apart from the settings model (core.settings) so that
what only needs a name loads no pydantic: `trialstream worker` hands over to the worker runtime with these
alone."""

PREFIX = "TRIALSTREAM_"
REDIS_URL_ENV = f"{PREFIX}REDIS_URL"
EXPERIMENTS_DIR_ENV = f"{PREFIX}EXPERIMENTS_DIR"  # the setting `experiments_dir`, named where it cannot be used
MANAGER_TOKEN_ENV = f"{PREFIX}MANAGER_TOKEN"  # the setting `manager_token`, named where a message tells the user
TLS_CA_ENV = f"{PREFIX}REDIS_TLS_CA_FILE"  # the setting `redis_tls_ca_file`, named where a wrong CA is reported
