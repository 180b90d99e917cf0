"""SimulatedWorkspace: the control plane's state (workspace, datastore, code and environment assets, jobs),
Azurite behind the datastore, the CONNECT proxy that stands in for the storage account's DNS name, and the
compute that runs each command job (simulators.amlsim.compute)."""

from __future__ import annotations

import copy
import datetime as dt
import threading
import uuid
from pathlib import Path
from typing import Any

from azure.storage.blob import ContainerSasPermissions, generate_container_sas

from simulators.amlsim.azurite import ACCOUNT, ACCOUNT_KEY, Azurite
from simulators.amlsim.compute import Compute
from simulators.amlsim.proxy import ConnectProxy
from simulators.amlsim.server import ControlPlane, HttpError, Request, not_found
from simulators.tls import make_self_signed

SUBSCRIPTION = "00000000-0000-0000-0000-0000000000a1"
RESOURCE_GROUP = "nni-rg"
WORKSPACE_NAME = "nni-ws"
COMPUTE_TARGET = "cpu-cluster"
STORAGE_SUFFIX = "amlsim.test"  # the cloud's storage suffix: accounts are https://<account>.blob.amlsim.test
DATASTORE = "workspaceblobstore"
TERMINAL = {"Completed", "Failed", "Canceled"}


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def storage_service(root: Path) -> Azurite:
    """Azurite for the simulated storage accounts, with a certificate for their names (the control plane
    serves with it too). It is started once and shared: each workspace keeps its own container in it."""
    cert, key = make_self_signed(root / "pki", "amlsim", (f"*.blob.{STORAGE_SUFFIX}",))
    return Azurite(root / "azurite", cert, key)


class SimulatedWorkspace:
    def __init__(self, storage: Azurite) -> None:
        self.azurite = storage
        self.ca = storage.cert
        self.storage_suffix = STORAGE_SUFFIX
        self.container = f"azureml-blobstore-{uuid.uuid4()}"
        self.workspace_id = str(uuid.uuid4())
        self.computes = {COMPUTE_TARGET}
        self.api = ControlPlane(self, storage.cert, storage.key)
        self.proxy: ConnectProxy | None = None
        self.assets: dict[tuple[str, str, str | None], dict[str, Any]] = {}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.compute = Compute(self)

    # lifecycle

    def start(self) -> None:
        """The control plane, the proxy to the (running) storage service, and this workspace's container."""
        self.proxy = ConnectProxy(self.azurite.port)
        self.proxy.start()
        self.api.start()
        self.compute.blobs().create_container(self.container)

    def stop(self) -> None:
        self.compute.stop()
        self.api.stop()
        if self.proxy is not None:
            self.proxy.stop()
        self.compute.blobs().delete_container(self.container)

    def environment(self) -> dict[str, str]:
        """What a process needs to reach this workspace through the real SDK and DefaultAzureCredential: the
        cloud's metadata URL, the CA bundle, a managed identity's endpoint, and the proxy for storage names."""
        assert self.proxy is not None
        return {
            "ARM_CLOUD_METADATA_URL": f"{self.api.url}/metadata/endpoints?api-version=2019-05-01",
            "REQUESTS_CA_BUNDLE": str(self.ca),
            "SSL_CERT_FILE": str(self.ca),
            "IDENTITY_ENDPOINT": f"{self.api.url}/identity/token",
            "IDENTITY_HEADER": self.api.identity_secret,
            "HTTPS_PROXY": f"http://127.0.0.1:{self.proxy.port}",
            "NO_PROXY": "127.0.0.1,localhost",
        }

    def section(self, **extra: Any) -> dict[str, Any]:
        """NNI's `aml` trainingService section for this workspace."""
        return {
            "platform": "aml",
            "subscriptionId": SUBSCRIPTION,
            "resourceGroup": RESOURCE_GROUP,
            "workspaceName": WORKSPACE_NAME,
            "computeTarget": COMPUTE_TARGET,
            "dockerImage": "msranni/nni:latest",
            **extra,
        }

    def arm_id(self, *parts: str) -> str:
        base = (
            f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{RESOURCE_GROUP}"
            f"/providers/Microsoft.MachineLearningServices/workspaces/{WORKSPACE_NAME}"
        )
        return "/".join([base, *parts])

    def _workspace(self, match: Any) -> None:
        if (match["sub"], match["rg"].lower(), match["ws"]) != (SUBSCRIPTION, RESOURCE_GROUP, WORKSPACE_NAME):
            raise not_found(f"Workspace {match['sub']}/{match['rg']}/{match['ws']}")

    # the workspace and its datastore

    def get_workspace(self, request: Request, match: Any) -> tuple[int, Any]:
        self._workspace(match)
        return 200, {
            "id": self.arm_id(),
            "name": WORKSPACE_NAME,
            "type": "Microsoft.MachineLearningServices/workspaces",
            "location": "simregion",
            "kind": "Default",
            "properties": {
                "workspaceId": self.workspace_id,
                "friendlyName": WORKSPACE_NAME,
                "discoveryUrl": f"{self.api.url}/discovery",
                "provisioningState": "Succeeded",
                "storageAccount": f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{RESOURCE_GROUP}"
                f"/providers/Microsoft.Storage/storageAccounts/{ACCOUNT}",
            },
        }

    def _datastore(self) -> dict[str, Any]:
        return {
            "id": self.arm_id("datastores", DATASTORE),
            "name": DATASTORE,
            "type": "Microsoft.MachineLearningServices/workspaces/datastores",
            "properties": {
                "datastoreType": "AzureBlob",
                "accountName": ACCOUNT,
                "containerName": self.container,
                "endpoint": STORAGE_SUFFIX,
                "protocol": "https",
                "isDefault": True,
                "credentials": {"credentialsType": "AccountKey"},
                "serviceDataAccessAuthIdentity": "None",
            },
        }

    def list_datastores(self, request: Request, match: Any) -> tuple[int, Any]:
        self._workspace(match)
        default = request.query.get("isDefault", "").lower() == "true"
        return 200, {"value": [self._datastore()] if default or not request.query.get("names") else []}

    def get_datastore(self, request: Request, match: Any) -> tuple[int, Any]:
        self._workspace(match)
        if match["name"] != DATASTORE:
            raise not_found(f"Datastore {match['name']}")
        return 200, self._datastore()

    def list_secrets(self, request: Request, match: Any) -> tuple[int, Any]:
        self._workspace(match)
        if match["name"] != DATASTORE:
            raise not_found(f"Datastore {match['name']}")
        return 200, {"secretsType": "AccountKey", "key": ACCOUNT_KEY}

    def get_compute(self, request: Request, match: Any) -> tuple[int, Any]:
        self._workspace(match)
        if match["name"] not in self.computes:
            raise not_found(f"Compute {match['name']}")
        return 200, {
            "id": self.arm_id("computes", match["name"]),
            "name": match["name"],
            "type": "Microsoft.MachineLearningServices/workspaces/computes",
            "location": "simregion",
            "properties": {
                "computeType": "AmlCompute",
                "provisioningState": "Succeeded",
                "properties": {"vmSize": "STANDARD_DS3_V2", "scaleSettings": {"maxNodeCount": 4, "minNodeCount": 0}},
            },
        }

    # code and environment assets

    def get_asset(self, request: Request, match: Any) -> tuple[int, Any]:
        self._workspace(match)
        key = (match["kind"], match["name"], match.groupdict().get("version"))
        with self.lock:
            asset = self.assets.get(key)
        if asset is None:
            raise not_found(f"{match['kind']} {match['name']}:{key[2]}")
        return 200, asset

    def list_asset_versions(self, request: Request, match: Any) -> tuple[int, Any]:
        """A name's versions; `hash` finds the one uploaded with that content hash (the SDK's re-use check)."""
        self._workspace(match)
        wanted = request.query.get("hash")
        with self.lock:
            found = [
                asset
                for (kind, name, version), asset in self.assets.items()
                if (kind, name) == (match["kind"], match["name"])
                and version is not None
                and (wanted is None or asset["properties"].get("properties", {}).get("hash_sha256") == wanted)
            ]
        return 200, {"value": found}

    def pending_upload(self, request: Request, match: Any) -> tuple[int, Any]:
        """Where the SDK uploads an asset's files: a folder of the datastore's container, with a SAS to write it."""
        self._workspace(match)
        upload = str(uuid.uuid4())
        expiry = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        sas = generate_container_sas(
            ACCOUNT, self.container, account_key=ACCOUNT_KEY,
            permission=ContainerSasPermissions(read=True, write=True, list=True, add=True, create=True), expiry=expiry,
        )  # fmt: skip
        container_url = f"https://{ACCOUNT}.blob.{STORAGE_SUFFIX}/{self.container}"
        return 200, {
            "pendingUploadId": upload,
            "pendingUploadType": "TemporaryBlobReference",
            "blobReferenceForConsumption": {
                "blobUri": f"{container_url}/LocalUpload/{upload}",
                "credential": {"credentialType": "SAS", "sasUri": f"{container_url}/LocalUpload/{upload}?{sas}"},
            },
        }

    def put_asset(self, request: Request, match: Any) -> tuple[int, Any]:
        self._workspace(match)
        version = match.groupdict().get("version")
        key = (match["kind"], match["name"], version)
        body = request.json() or {}
        parts = [match["kind"], match["name"]] + (["versions", version] if version else [])
        with self.lock:
            created = key not in self.assets
            path = (body.get("properties") or {}).get("codeUri")
            if not created and version and path != self.assets[key]["properties"].get("codeUri"):
                raise HttpError(400, "UserError", "Asset paths cannot be updated.")  # versions are immutable
            self.assets[key] = {
                "id": self.arm_id(*parts),
                "name": version or match["name"],
                "type": f"Microsoft.MachineLearningServices/workspaces/{match['kind']}"
                + ("/versions" if version else ""),
                "properties": {**body.get("properties", {}), "provisioningState": "Succeeded"},
                "systemData": {"createdAt": _now(), "createdBy": "amlsim"},
            }
            return (201 if created else 200), self.assets[key]

    # jobs

    def _job_answer(self, job: dict[str, Any]) -> dict[str, Any]:
        return copy.deepcopy(job)

    def list_jobs(self, request: Request, match: Any) -> tuple[int, Any]:
        self._workspace(match)
        with self.lock:
            return 200, {"value": [self._job_answer(job) for job in self.jobs.values()]}

    def get_job(self, request: Request, match: Any) -> tuple[int, Any]:
        self._workspace(match)
        with self.lock:
            job = self.jobs.get(match["name"])
            if job is None:
                raise not_found(f"Job {match['name']}")
            return 200, self._job_answer(job)

    def put_job(self, request: Request, match: Any) -> tuple[int, Any]:
        self._workspace(match)
        name = match["name"]
        properties = dict((request.json() or {}).get("properties") or {})
        if properties.get("jobType") != "Command":
            raise HttpError(400, "UserError", f"the simulator runs command jobs only, not {properties.get('jobType')}")
        compute = str(properties.get("computeId") or "").rsplit("/", 1)[-1]
        if compute not in self.computes:
            raise HttpError(400, "UserError", f"Compute {compute!r} was not found in workspace {WORKSPACE_NAME}")
        with self.lock:
            if name in self.jobs:
                raise HttpError(409, "UserError", f"A job with the name {name} already exists")
            properties.update(status="NotStarted", services={})
            job = {
                "id": self.arm_id("jobs", name),
                "name": name,
                "type": "Microsoft.MachineLearningServices/workspaces/jobs",
                "properties": properties,
                "systemData": {"createdAt": _now(), "createdBy": "amlsim"},
            }
            self.jobs[name] = job
            answer = self._job_answer(job)
        self.compute.submit(name)
        return 201, answer

    def cancel_job(self, request: Request, match: Any) -> tuple[int, Any]:
        self._workspace(match)
        name = match["name"]
        with self.lock:
            job = self.jobs.get(name)
            if job is None:
                raise not_found(f"Job {name}")
            if job["properties"]["status"] not in TERMINAL:
                job["properties"]["status"] = "CancelRequested"
        self.compute.cancel(name)
        return 202, (None, {"Location": f"{self.api.url}/operations/cancel/{name}"})

    def cancel_operation(self, request: Request, match: Any) -> tuple[int, Any]:
        with self.lock:
            job = self.jobs.get(match["name"])
            done = job is None or job["properties"]["status"] in TERMINAL
        if not done:
            return 202, (None, {"Location": f"{self.api.url}/operations/cancel/{match['name']}", "Retry-After": "1"})
        return 200, None

    def set_status(self, name: str, status: str) -> bool:
        """The compute's report; an ended job stays as it ended (a cancel that came late changes nothing)."""
        with self.lock:
            job = self.jobs[name]
            current = job["properties"]["status"]
            if current in TERMINAL or (current == "CancelRequested" and status not in TERMINAL):
                return False
            job["properties"]["status"] = status
            return True

    def job(self, name: str) -> dict[str, Any]:
        with self.lock:
            return copy.deepcopy(self.jobs[name])
