"""A small asyncio Kubernetes REST client for the operator's writes (children and status).

kopf brings no client for arbitrary objects. This one is a few generic verbs over httpx (a core
dependency) on the credentials kopf's login produced (``kopf.ConnectionInfo``: in-cluster service
account or kubeconfig, loaded by the ``kubernetes`` package through ``kopf.login_via_client``).
Working on raw paths and dicts keeps it independent of the generated ``kubernetes`` API classes, whose
signatures change between releases, and keeps every call on the operator's event loop.

Writes are server-side apply (``application/apply-patch+yaml`` with a JSON body, ``force=true``,
field manager ``pagedserve-operator``) for existing objects and POST for new ones, which also works
on emulators without PUT or apply-creates.
"""

from __future__ import annotations

import asyncio
import ssl
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

FIELD_MANAGER = "pagedserve-operator"


class KubeError(Exception):
    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(f"{status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message


def api_prefix(api_version: str) -> str:
    return "/api/v1" if api_version == "v1" else f"/apis/{api_version}"


def object_path(api_version: str, plural: str, namespace: str | None, name: str | None = None) -> str:
    path = api_prefix(api_version)
    if namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    if name:
        path += f"/{name}"
    return path


def _write_temp(data: bytes | str) -> str:
    handle = tempfile.NamedTemporaryFile(delete=False, suffix=".pem")  # noqa: SIM115 - kept for ssl
    handle.write(data.encode() if isinstance(data, str) else data)
    handle.close()
    return handle.name


class Kube:
    """Generic async verbs on raw paths; 404 on get/delete is an answer, not an error."""

    def __init__(
        self,
        info: Any,
        *,
        relogin: Callable[[], Awaitable[Any]] | None = None,
        timeout: float = 30.0,
    ) -> None:
        self._relogin = relogin
        self._timeout = timeout
        self._client: httpx.AsyncClient | None = None
        self._lock = asyncio.Lock()
        self._served: dict[str, tuple[float, bool]] = {}
        self.set_credentials(info)

    # -- connection ----------------------------------------------------------------------------

    def set_credentials(self, info: Any) -> None:
        """Take a kopf.ConnectionInfo (server, TLS material, token or basic auth).

        A live client keeps its connection and TLS setup and only takes the new token (a re-login
        after 401 renews tokens; the server and certificates of a running operator do not change).
        """
        self._info = info
        if self._client is not None:
            headers, auth = self._auth(info)
            self._client.headers.update(headers)
            self._client.auth = auth

    @staticmethod
    def _auth(info: Any) -> tuple[dict[str, str], httpx.BasicAuth | None]:
        if getattr(info, "token", None):
            return {"Authorization": f"{info.scheme or 'Bearer'} {info.token}"}, None
        if getattr(info, "username", None):
            return {}, httpx.BasicAuth(info.username, info.password or "")
        return {}, None

    def _make_client(self) -> httpx.AsyncClient:
        info = self._info
        verify: ssl.SSLContext | bool
        if getattr(info, "insecure", False):
            verify = False
        else:
            ca_path = getattr(info, "ca_path", None)
            ca_data = getattr(info, "ca_data", None)
            verify = ssl.create_default_context(cafile=ca_path)
            if ca_data:
                verify.load_verify_locations(
                    cadata=ca_data.decode() if isinstance(ca_data, bytes) else ca_data
                )
            cert = getattr(info, "certificate_path", None)
            key = getattr(info, "private_key_path", None)
            if getattr(info, "certificate_data", None):
                cert = _write_temp(info.certificate_data)
            if getattr(info, "private_key_data", None):
                key = _write_temp(info.private_key_data)
            if cert:
                verify.load_cert_chain(cert, key)
        headers, auth = self._auth(info)
        headers.update({"Accept": "application/json", "User-Agent": FIELD_MANAGER})
        return httpx.AsyncClient(
            base_url=info.server.rstrip("/"),
            verify=verify,
            headers=headers,
            auth=auth,
            timeout=self._timeout,
            trust_env=bool(getattr(info, "trust_env", False)),
        )

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        """One call; re-login once on 401; KubeError on any other non-2xx answer."""
        for attempt in range(2):
            if self._client is None:
                self._client = self._make_client()
            response = await self._client.request(
                method,
                path,
                json=body,
                params=params,
                headers={"Content-Type": content_type} if body is not None else None,
            )
            if response.status_code == 401 and attempt == 0 and self._relogin is not None:
                async with self._lock:
                    self.set_credentials(await self._relogin())
                continue
            break
        if response.status_code >= 400:
            reason, message = response.reason_phrase, response.text
            try:
                status = response.json()
                reason, message = status.get("reason") or reason, status.get("message") or message
            except ValueError:
                pass
            raise KubeError(response.status_code, message, reason)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return None

    # -- verbs ---------------------------------------------------------------------------------

    async def get(
        self, api_version: str, plural: str, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        try:
            return await self.request("GET", object_path(api_version, plural, namespace, name))
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    async def list(
        self, api_version: str, plural: str, namespace: str | None, label_selector: str
    ) -> list[dict[str, Any]]:
        listed = await self.request(
            "GET", object_path(api_version, plural, namespace), params={"labelSelector": label_selector}
        )
        return list((listed or {}).get("items") or [])

    async def create(self, plural: str, manifest: dict[str, Any]) -> dict[str, Any]:
        meta = manifest["metadata"]
        path = object_path(manifest["apiVersion"], plural, meta.get("namespace"))
        return await self.request("POST", path, body=manifest, params={"fieldManager": FIELD_MANAGER})

    async def apply(self, plural: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply of the whole manifest, taking over fields from other managers."""
        meta = manifest["metadata"]
        path = object_path(manifest["apiVersion"], plural, meta.get("namespace"), meta["name"])
        return await self.request(
            "PATCH",
            path,
            body=manifest,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",
        )

    async def merge_patch(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        name: str,
        patch: dict[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        path = object_path(api_version, plural, namespace, name)
        if subresource:
            path += f"/{subresource}"
        return await self.request("PATCH", path, body=patch, content_type="application/merge-patch+json")

    async def delete(self, api_version: str, plural: str, namespace: str | None, name: str) -> bool:
        """Delete in the background (dependents by the garbage collector); False if it was not there."""
        try:
            await self.request(
                "DELETE",
                object_path(api_version, plural, namespace, name),
                params={"propagationPolicy": "Background"},
            )
        except KubeError as error:
            if error.status == 404:
                return False
            raise
        return True

    async def served(self, api_version: str, plural: str, ttl: float = 60.0) -> bool:
        """Whether the API server serves this resource (discovery, cached for ``ttl`` seconds)."""
        key = f"{api_version}/{plural}"
        now = asyncio.get_running_loop().time()
        cached = self._served.get(key)
        if cached is not None and now - cached[0] < ttl:
            return cached[1]
        try:
            listing = await self.request("GET", api_prefix(api_version))
            names = {resource.get("name") for resource in (listing or {}).get("resources", [])}
            answer = plural in names
        except KubeError as error:
            if error.status not in (404, 403):
                raise
            answer = False
        self._served[key] = (now, answer)
        return answer
