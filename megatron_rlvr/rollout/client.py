"""One async HTTP client for an SGLang-API engine (real SGLang or the CPU engine), with
timeouts, retries for transient failures, and a health record the rollout manager reads.

A 4xx is the engine refusing the request: never retried, raised with the engine's message.
Every request carries the run's API key (Authorization: Bearer), which SGLang's --api-key and
the CPU engine check: a request without it is refused (401) and changes nothing.
Connection errors, timeouts and 5xx are transient: retried with backoff, then raised as
EngineUnavailable (the manager moves the work to another engine).

Health is three states, not two (`EngineClient.state`). SGLang's /health generates one token,
and generation waits while the engine is paused, so a healthy engine paused for a weight sync
fails it (and after 20 s SGLang marks itself unhealthy). So /health is asked only of an engine
that says it is not paused: /ready (200: not paused and healthy) and /ping (200: healthy,
paused or not) are flag checks the HTTP process answers without its scheduler."""

from __future__ import annotations

import asyncio
import enum
from typing import Any

import httpx

from megatron_rlvr.rollout import protocol as p

ENGINE_API_KEY_ENV = "MEGATRON_RLVR_ENGINE_API_KEY"  # how the CPU engine gets the run's key


class EngineRequestError(ValueError):
    """The engine refused the request (HTTP 4xx)."""


class EngineUnavailable(ConnectionError):
    """The engine did not answer after retries."""


class EngineState(enum.Enum):
    SERVING = "serving"  # not paused, and a one-token generation came back
    PAUSED = "paused"  # alive and healthy, generation paused (a weight sync): requests wait
    DOWN = "down"  # no answer, starting, shutting down, or a generation that never came back


HEALTH_TIMEOUT_S = 5.0  # one health question; SGLang's own generation check gives up after 20 s


class EngineClient:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        retries: int = 2,
        backoff_s: float = 0.2,
        update_timeout_s: float = 600.0,
    ):
        self.base_url = base_url.rstrip("/")
        self.retries, self.backoff_s = retries, backoff_s
        self.timeout_s, self.update_timeout_s = timeout_s, update_timeout_s
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=5.0), headers=auth_headers(api_key)
        )
        self.healthy = True
        self.failures = 0
        self.in_flight = 0

    async def _request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        *,
        timeout_s: float | None = None,
        retries: int | None = None,
    ) -> Any:
        attempts = (self.retries if retries is None else retries) + 1
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                response = await self._http.request(method, path, json=body, timeout=timeout_s or self.timeout_s)
            except (httpx.TransportError, httpx.TimeoutException) as err:
                last = err
            else:
                if response.status_code < 400:
                    self.failures, self.healthy = 0, True
                    return _body(response)
                if response.status_code < 500:
                    raise EngineRequestError(
                        f"{self.base_url}{path}: HTTP {response.status_code}: {_message(response)}"
                    )
                last = RuntimeError(f"HTTP {response.status_code}: {_message(response)}")
            if attempt + 1 < attempts:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        self.failures += 1
        self.healthy = False
        raise EngineUnavailable(f"{self.base_url}{path}: {type(last).__name__}: {last}".rstrip(": "))

    # ------------------------------------------------------------------ generation
    async def generate(self, request: p.GenerateReqInput) -> list[p.GenerateResponse]:
        """Always a list (one per prompt × n), whatever shape SGLang answered in."""
        self.in_flight += 1
        try:
            data = await self._request("POST", "/generate", request.model_dump(exclude_none=True), retries=0)
        finally:
            self.in_flight -= 1
        rows = data if isinstance(data, list) else [data]
        return [p.GenerateResponse.model_validate(row) for row in rows]

    async def abort(self, rid: str = "", abort_all: bool = False) -> None:
        await self._request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause(self, mode: str = "retract") -> None:
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache")

    async def health(self) -> bool:
        """Alive: serving, or paused (a paused engine is not dead; it serves after resume)."""
        return await self.state() is not EngineState.DOWN

    async def state(self) -> EngineState:
        """Serving, paused or down. /ready 200 (not paused, healthy): the one-token /health
        decides, as SGLang's scheduler must answer it. /ready 503 with /ping 200: paused. Both
        503: starting, shutting down, or flagged unhealthy by an earlier failed /health, which
        a generation that comes back clears. A /health that fails after /ready said 200 may
        have met a pause that began meanwhile: /ready and /ping are asked again."""
        state = await self._ask_state()
        self.healthy = state is not EngineState.DOWN
        return state

    async def _ask_state(self) -> EngineState:
        ready = await self._status("/ready")
        if ready is None:
            return EngineState.DOWN
        if ready != 200 and await self._status("/ping") == 200:
            return EngineState.PAUSED
        if await self._status("/health") == 200:
            return EngineState.SERVING
        if await self._status("/ready") == 503 and await self._status("/ping") == 200:
            return EngineState.PAUSED
        return EngineState.DOWN

    async def _status(self, path: str) -> int | None:
        """The HTTP status of one GET (None: no answer within HEALTH_TIMEOUT_S), no retries."""
        try:
            response = await self._http.get(path, timeout=HEALTH_TIMEOUT_S)
        except (httpx.TransportError, httpx.TimeoutException):
            return None
        return response.status_code

    async def model_info(self, retries: int | None = None) -> dict:
        return await self._request("GET", "/model_info", retries=retries)

    # ------------------------------------------------------------------ weight updates
    async def init_weights_update_group(self, req: p.InitWeightsUpdateGroupReqInput) -> None:
        await self._request(
            "POST", "/init_weights_update_group", req.model_dump(), timeout_s=self.update_timeout_s, retries=0
        )

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self._request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def begin_weight_update(self, selector: str = "target") -> None:
        await self._request("POST", "/begin_weight_update", {"selector": selector})

    async def end_weight_update(self) -> None:
        await self._request("POST", "/end_weight_update", {})

    async def update_weights_from_distributed(self, req: p.UpdateWeightsFromDistributedReqInput) -> None:
        await self._request(
            "POST",
            "/update_weights_from_distributed",
            req.model_dump(exclude_none=True),
            timeout_s=self.update_timeout_s,
            retries=0,
        )

    # ------------------------------------------------------------------ colocation
    async def release_memory_occupation(self, tags: list[str] | None = None, *, timeout_s: float | None = None) -> None:
        """Frees the engine's memory for `tags` (kv_cache, weights, cuda_graph; None: all).
        Refused (EngineRequestError) unless the engine is idle. No retry: a release that
        timed out may have happened."""
        await self._bounded("/release_memory_occupation", p.ReleaseMemoryOccupationReqInput(tags=tags), timeout_s)

    async def resume_memory_occupation(self, tags: list[str] | None = None, *, timeout_s: float | None = None) -> None:
        """Allocates `tags` again (None: all released). Weights come back as zeros or garbage
        unless the engine keeps a CPU backup: push them again (update_weights_from_tensor)."""
        await self._bounded("/resume_memory_occupation", p.ResumeMemoryOccupationReqInput(tags=tags), timeout_s)

    async def update_weights_from_tensor(
        self, req: p.UpdateWeightsFromTensorReqInput, *, timeout_s: float | None = None
    ) -> None:
        """Loads one payload per engine TP rank (weight_sync/tensor_handover.py builds them),
        inside a begin/end weight-update session. The engine answers before its device copy
        is done on GPU: the sender keeps the tensors alive after the reply."""
        await self._bounded("/update_weights_from_tensor", req, timeout_s)

    async def _bounded(self, path: str, req: p.Strict, timeout_s: float | None) -> None:
        """One POST, no retries, given up after timeout_s (default update_timeout_s): a
        failure is EngineUnavailable naming the engine, the endpoint and the wait."""
        bound = timeout_s or self.update_timeout_s
        try:
            await asyncio.wait_for(
                self._request("POST", path, req.model_dump(exclude_none=True), timeout_s=bound, retries=0), bound + 1.0
            )
        except (TimeoutError, EngineUnavailable) as err:
            raise EngineUnavailable(
                f"waited up to {bound:g} s for {self.base_url}{path}: {type(err).__name__}: {err}".rstrip(": ")
            ) from err

    async def close(self) -> None:
        await self._http.aclose()


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header an engine started with `api_key` requires (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _body(response: httpx.Response) -> Any:
    """JSON, or the text of the endpoints SGLang answers in plain text (/flush_cache)."""
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or f"HTTP {response.status_code}"
    if isinstance(body, dict):
        return str(body.get("message") or body.get("error", {}).get("message") or body)[:500]
    return str(body)[:500]
