# trialstream: one image for every process of the stack (manager, workers).
#   docker build -t trialstream .                 (docker compose build does the same)
# With no image registry in reach, build on a base made from Debian's packages (deploy/base-image.sh):
#   docker build --build-arg BASE_IMAGE=trialstream-base:bookworm -t trialstream .
# No secrets are baked in: the Redis password, the manager's token and SSH keys come at run time.

ARG BASE_IMAGE=python:3.11-slim

# --- dependencies stage: a virtualenv with every dependency, named by pyproject.toml alone, so that this
# layer (a minute of installing, 800 MB) is rebuilt when they change, not with every change to the sources.
FROM ${BASE_IMAGE} AS dependencies
# pip reads its settings from the environment, and build arguments are environment variables of RUN:
# PIP_INDEX_URL for a mirror, PIP_NO_INDEX=1 to install from deploy/wheels alone (offline).
ARG PIP_INDEX_URL
ARG PIP_NO_INDEX
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/venv
# Wheels put in deploy/wheels beforehand (`pip wheel -w deploy/wheels '.[nni]'`) are taken first.
COPY deploy/wheels/ /wheels/
WORKDIR /src
COPY pyproject.toml ./
# nni: trials `import nni`, the manager serves NNI's web UI and runs its tuners. NNI's own manager (Node.js
# and its modules, 160 MB) is what trialstream replaces: only the web UI's files are kept. s3: archives in a bucket.
RUN /opt/venv/bin/python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + p["optional-dependencies"]["nni"] + p["optional-dependencies"]["s3"]))' \
  > /tmp/requirements.txt \
 && /opt/venv/bin/pip install --find-links /wheels -r /tmp/requirements.txt \
 && rm -rf /opt/venv/lib/python3*/site-packages/nni_node/node /opt/venv/lib/python3*/site-packages/nni_node/node_modules

# --- package stage: trialstream's own wheel, from only what it needs (.dockerignore keeps the rest: .git,
# .env, tests); the sources and wheels stay in these stages.
FROM dependencies AS package
COPY README.md trialstream_sdk.py ./
COPY schemas/ schemas/
COPY core/ core/
COPY manager/ manager/
COPY workers/ workers/
RUN /opt/venv/bin/pip wheel --no-deps --find-links /wheels -w /dist .

# --- runtime stage -----------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
# Match UID/GID to the host user that owns the SSH keys given to the remote workers (deploy/README.md).
ARG UID=1000
ARG GID=1000
# The experiments directory is created here, owned by the user, so a fresh named volume mounted on
# it inherits that ownership: uploaded code and the trials' directories, shared by manager and workers.
# /opt/trialstream, the processes' working directory, is root's: `python -m workers` puts it first on
# sys.path, so it must not be one that trials (the same user) can write a module into.
RUN groupadd --gid "${GID}" trialstream \
 && useradd --uid "${UID}" --gid "${GID}" --create-home --shell /usr/sbin/nologin trialstream \
 && install -d -o trialstream -g trialstream /home/trialstream/trialstream-experiments \
 && install -d /opt/trialstream

COPY --from=dependencies /opt/venv /opt/venv
RUN --mount=type=bind,from=package,source=/dist,target=/dist /opt/venv/bin/pip install -q --no-deps /dist/*.whl
# PYTHONUNBUFFERED: log lines reach `docker compose logs` at once, not when a buffer fills.
# The venv is first on PATH, so a trial's `python3 trial.py` finds nni and trialstream_sdk.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/trialstream

USER trialstream
WORKDIR /opt/trialstream
CMD ["trialstream", "--help"]
