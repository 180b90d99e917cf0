# syntax=docker/dockerfile:1
# trialstream: one image for every process of the stack (projector, workers, runner).
#   docker build -t trialstream .      (docker compose build does the same)
# No secrets are baked in: the Redis URL (with its password) comes from the environment at run time.

ARG PYTHON_IMAGE=python:3.11-slim

# --- build stage: install the package into a virtualenv; the source tree stays behind ---------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
# Only what `pip install .` needs (pyproject's packages, py-modules and readme); .dockerignore keeps
# the rest (.git, .env, tests, experiments) out of the build context altogether.
COPY pyproject.toml README.md ./
COPY trialstream_sdk.py ./
COPY schemas/ schemas/
COPY core/ core/
COPY manager/ manager/
COPY workers/ workers/
RUN /opt/venv/bin/pip install --no-cache-dir .

# --- runtime stage ------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
# Match UID/GID to the host user that owns ./experiments so trials can write into the bind mount:
#   docker compose build --build-arg UID=$(id -u) --build-arg GID=$(id -g)
ARG UID=1000
ARG GID=1000
# The mount points are created here, owned by the user, so fresh named volumes inherit that ownership:
# /experiments (trial code, bind-mounted) and ~/trialstream-experiments (the runner's default
# experimentWorkingDirectory, shared by the runner and the workers).
RUN groupadd --gid "${GID}" trialstream \
 && useradd --uid "${UID}" --gid "${GID}" --create-home --shell /usr/sbin/nologin trialstream \
 && mkdir -p /experiments /home/trialstream/trialstream-experiments \
 && chown trialstream:trialstream /experiments /home/trialstream/trialstream-experiments

COPY --from=build /opt/venv /opt/venv
# PYTHONUNBUFFERED: log lines reach `docker compose logs` at once, not when a buffer fills.
# The venv is first on PATH, so a trial's `python3 trial.py` finds trialstream_sdk too.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/trialstream

USER trialstream
WORKDIR /home/trialstream
CMD ["trialstream", "--help"]
