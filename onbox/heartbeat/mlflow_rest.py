"""The few calls of MLflow's REST API (`/api/2.0/mlflow/...`) the MLflow sink needs, over `requests`: onbox.pyz
carries no mlflow package. Every request has a timeout; HTTP(S)_PROXY / NO_PROXY apply (trust_env).

Credentials come from the agent's environment or a file, never argv or config.json (U34), in the mlflow client's
order: `--mlflow-token-file` (bearer), else MLFLOW_TRACKING_USERNAME + MLFLOW_TRACKING_PASSWORD (basic), else
MLFLOW_TRACKING_TOKEN (bearer). They are read again after a 401/403 (a rotated token file).

Errors: `SinkError` for what a retry may cure (unreachable, timeout, 5xx, 429, refused credentials, a URL that
does not answer like MLflow); `MlflowError` for an answer MLflow gave with an error code (the caller decides).
"""
from __future__ import annotations

import base64
import json
import os
from typing import Any, Dict, List, Mapping, Optional

from onbox.fsutil import read_token_file
from onbox.heartbeat.sinks import SinkError, _session

API = "/api/2.0/mlflow/"
TOKEN_ENV, USER_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"


class MlflowError(Exception):
    """MLflow answered 4xx with its JSON error body: {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": ...}."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__("%s (%d): %s" % (code, status, message))
        self.status, self.code, self.message = status, code, message


def auth_header(token_file: Optional[str], environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The Authorization header value, or None (a server without auth). Raises OSError for an unreadable file."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    token = read_token_file(token_file) if token_file else ""
    if token:
        return "Bearer " + token
    user, password = env.get(USER_ENV), env.get(PASSWORD_ENV)
    if user and password:
        return "Basic " + base64.b64encode(("%s:%s" % (user, password)).encode("utf-8")).decode("ascii")
    env_token = env.get(TOKEN_ENV)
    return ("Bearer " + env_token) if env_token else None


class MlflowRest:
    def __init__(self, url: str, token_file: Optional[str] = None, timeout: float = 10.0,
                 environ: Optional[Mapping[str, str]] = None) -> None:
        self.base = url.rstrip("/") + API
        self.token_file = token_file
        self.timeout = timeout
        self.environ = environ
        self.auth = auth_header(token_file, environ)  # OSError: the caller names the file
        self._http: Any = None

    def call(self, method: str, endpoint: str, body: Optional[Dict[str, Any]] = None,
             params: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
        import requests  # heavy import: only in the sender thread

        if self._http is None:
            self._http = _session()
        headers = {"Content-Type": "application/json"}
        if self.auth:
            headers["Authorization"] = self.auth
        data = None if body is None else json.dumps(body, separators=(",", ":"), allow_nan=False).encode("utf-8")
        try:
            r = self._http.request(method, self.base + endpoint, data=data, params=params, headers=headers,
                                   timeout=self.timeout)
        except requests.RequestException as e:
            raise SinkError("mlflow unreachable: %s" % e.__class__.__name__)
        if r.status_code == 200:
            try:
                doc = r.json()
            except ValueError:
                raise SinkError("mlflow %s answered 200 without JSON: is %s an MLflow server?" % (endpoint, self.base))
            return doc if isinstance(doc, dict) else {}
        if r.status_code in (401, 403):
            try:
                self.auth = auth_header(self.token_file, self.environ)  # the token may have been rotated
            except OSError:
                pass
            raise SinkError("mlflow refused the credentials (%d): check MLFLOW_TRACKING_TOKEN, "
                            "MLFLOW_TRACKING_USERNAME/PASSWORD or --mlflow-token-file" % r.status_code)
        if r.status_code == 429 or r.status_code >= 500:
            raise SinkError("mlflow answered %d on %s" % (r.status_code, endpoint))
        try:
            err = r.json()
        except ValueError:
            err = None
        if not isinstance(err, dict) or "error_code" not in err:  # not MLflow's own answer: a proxy, a wrong URL
            raise SinkError("no MLflow API at %s (%d on %s)" % (self.base, r.status_code, endpoint))
        raise MlflowError(r.status_code, str(err.get("error_code")), str(err.get("message", ""))[:500])

    # -- experiments
    def experiment_id(self, name: str) -> str:
        """The id of the experiment `name`, created when missing (another box creating it at the same moment is
        fine: RESOURCE_ALREADY_EXISTS means look it up again). A deleted one is an error the user must fix."""
        for _ in range(3):
            try:
                exp = self.call("GET", "experiments/get-by-name", params={"experiment_name": name})["experiment"]
            except MlflowError as e:
                if e.code != "RESOURCE_DOES_NOT_EXIST":
                    raise SinkError("mlflow: cannot look up experiment %r: %s" % (name, e))
            else:
                if exp.get("lifecycle_stage") == "deleted":
                    raise SinkError("mlflow: the experiment %r is deleted: restore it in MLflow, or give "
                                    "--mlflow-experiment another name" % name)
                return str(exp["experiment_id"])
            try:
                return str(self.call("POST", "experiments/create", {"name": name})["experiment_id"])
            except MlflowError as e:
                if e.code != "RESOURCE_ALREADY_EXISTS":
                    raise SinkError("mlflow: cannot create experiment %r: %s" % (name, e))
        raise SinkError("mlflow: experiment %r neither found nor created" % name)

    # -- runs
    def get_run(self, run_id: str) -> Optional[Dict[str, Any]]:
        """The run, or None when it no longer exists or was deleted."""
        try:
            run = self.call("GET", "runs/get", params={"run_id": run_id})["run"]
        except MlflowError as e:
            if e.code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise SinkError("mlflow: runs/get: %s" % e)
        return None if run.get("info", {}).get("lifecycle_stage") == "deleted" else run

    def runs_tagged(self, experiment_id: str, key: str, value: str) -> List[Dict[str, Any]]:
        """Active runs of the experiment whose tag `key` is `value`, oldest first (start time, then run id)."""
        flt = "tags.`%s` = '%s'" % (key, value.replace("'", "\\'"))
        try:
            doc = self.call("POST", "runs/search", {"experiment_ids": [experiment_id], "filter": flt,
                                                    "run_view_type": "ACTIVE_ONLY", "max_results": 50})
        except MlflowError as e:
            raise SinkError("mlflow: runs/search: %s" % e)
        runs = doc.get("runs") or []
        return sorted(runs, key=lambda r: (int(r["info"].get("start_time") or 0), str(r["info"]["run_id"])))

    def create_run(self, experiment_id: str, run_name: str, start_ms: int, tags: Dict[str, str]) -> Dict[str, Any]:
        try:
            return self.call("POST", "runs/create", {
                "experiment_id": experiment_id, "run_name": run_name, "start_time": start_ms,
                "tags": [{"key": k, "value": v} for k, v in sorted(tags.items())]})["run"]
        except MlflowError as e:
            raise SinkError("mlflow: runs/create: %s" % e)

    def delete_run(self, run_id: str) -> None:
        try:
            self.call("POST", "runs/delete", {"run_id": run_id})
        except MlflowError as e:
            raise SinkError("mlflow: runs/delete: %s" % e)

    def log_batch(self, run_id: str, metrics: List[Dict[str, Any]], params: Optional[Dict[str, str]] = None,
                  tags: Optional[Dict[str, str]] = None) -> None:
        """One runs/log-batch request (the caller keeps it inside MLflow's limits). MlflowError passes through."""
        body: Dict[str, Any] = {"run_id": run_id, "metrics": metrics}
        if params:
            body["params"] = [{"key": k, "value": v} for k, v in sorted(params.items())]
        if tags:
            body["tags"] = [{"key": k, "value": v} for k, v in sorted(tags.items())]
        self.call("POST", "runs/log-batch", body)

    def update_run(self, run_id: str, status: str, end_ms: Optional[int]) -> None:
        body: Dict[str, Any] = {"run_id": run_id, "status": status}
        if end_ms is not None:
            body["end_time"] = end_ms
        self.call("POST", "runs/update", body)

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
