"""The CPU engine's HTTP server: SGLang's endpoints, field names and replies, so the learner
side talks to it exactly as it talks to a real SGLang server.

    python -m megatron_rlvr.rollout.server --model-path DIR [--host 127.0.0.1] [--port 30000]
        [--dtype float32] [--enable-return-routed-experts]

With MEGATRON_RLVR_ENGINE_API_KEY in its environment (not argv: `ps` shows argv) every
request but /health* needs `Authorization: Bearer KEY`, as SGLang's --api-key does; one
without it gets 401 and changes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import threading
import time
from typing import cast

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import ENGINE_API_KEY_ENV
from megatron_rlvr.rollout.cpu_engine import CpuEngine, EngineError, Sequence
from megatron_rlvr.rollout.memory_api import MemoryOccupation, register_memory_api
from megatron_rlvr.rollout.openai_api import add_chat_endpoint
from megatron_rlvr.rollout.routed_experts import encode_routed_experts
from megatron_rlvr.rollout.weight_receiver import dtype_from_name, receive_bucket, receive_tensors
from megatron_rlvr.weight_sync.transport import open_group


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"success": False, "message": message, "error": {"message": message}}, status_code=status)


def _validation_message(err: ValidationError) -> str:
    parts = []
    for item in err.errors():
        where = ".".join(str(x) for x in item["loc"]) or "body"
        if item["type"] == "extra_forbidden":
            parts.append(f"{where}: unknown field")
        else:
            parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


async def _parse(request: Request, model: type[BaseModel]):
    try:
        body = await request.json() if await request.body() else {}
    except json.JSONDecodeError as err:
        raise EngineError(f"request body is not valid JSON ({err.msg})") from err
    if not isinstance(body, dict):
        raise EngineError("request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise EngineError(_validation_message(err)) from err


class WeightUpdates:
    """Update groups by name and the begin/end session SGLang 0.5.23 requires. A session's
    version becomes the engine's only when every update in it succeeded: after a corrupted
    or failed bucket the engine keeps reporting its old version, and /end_weight_update says
    why."""

    def __init__(self, engine: CpuEngine):
        self.engine = engine
        self.groups: dict[str, object] = {}
        self.session: dict | None = None  # {"failed": reason | None, "version": str | None}

    def check_version(self, version: str | None) -> None:
        """An older version is refused; the same one is taken again, as SGLang takes it: a
        sync cut short by another engine's death is sent whole again."""
        current = self.engine.weight_version
        if version is not None and _newer(version, current):
            raise EngineError(f"stale weight version {version}: this engine holds {current}")

    def apply(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        unknown = [n for n in names if n not in self.engine.weights]
        if unknown:
            raise EngineError(
                f"unknown weight names (first: {unknown[0]!r}); weights are HF names with experts one by one"
            )
        with self.engine.model_lock, torch.no_grad():
            for name, tensor in zip(names, tensors):
                target = self.engine.weights[name]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise EngineError(f"{name}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
                target.copy_(tensor.to(target.dtype))


HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang 0.5.23's SGLANG_HEALTH_CHECK_TIMEOUT default


def create_app(
    engine: CpuEngine,
    *,
    return_routed_experts: bool = False,
    api_key: str | None = None,
    weights_cpu_backup: bool = False,
) -> FastAPI:
    app = FastAPI(title="megatron-rlvr CPU engine (SGLang API)")
    updates = WeightUpdates(engine)
    register_memory_api(app, updates, MemoryOccupation(engine, weights_cpu_backup=weights_cpu_backup), _parse)

    if api_key:

        @app.middleware("http")
        async def require_key(request: Request, call_next):
            if request.url.path.startswith("/health") or _bearer_matches(request, api_key):
                return await call_next(request)
            return _error(401, "missing or wrong API key (Authorization: Bearer)")

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, err: EngineError):
        return _error(400, str(err))

    @app.api_route("/health", methods=["GET", "POST"])
    @app.api_route("/health_generate", methods=["GET", "POST"])
    async def health():
        """As SGLang's default /health: a generation, which waits while generation is paused
        (SGLang gives up after HEALTH_CHECK_TIMEOUT_S with 503)."""
        deadline = time.monotonic() + HEALTH_CHECK_TIMEOUT_S
        while engine.paused and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return Response(status_code=503 if engine.paused else 200)

    @app.get("/ready")
    async def ready():
        """As SGLang's: 200 when healthy and not paused."""
        return Response(status_code=503 if engine.paused else 200)

    @app.get("/ping")
    async def ping():
        """As SGLang's: 200 when healthy, paused or not (a flag, no generation)."""
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return {
            "model_path": engine.model_dir,
            "tokenizer_path": engine.model_dir,
            "is_generation": True,
            "weight_version": engine.weight_version,
            "architectures": list(getattr(engine.config, "architectures", []) or []),
        }

    @app.post("/generate")
    async def generate(request: Request):
        req = await _parse(request, p.GenerateReqInput)
        if req.stream:
            raise EngineError("stream: streaming is not supported by the CPU engine")
        prompts = _prompts(req, engine)
        rids = req.rid if isinstance(req.rid, list) else [req.rid] * len(prompts)
        if len(rids) != len(prompts):
            raise EngineError(f"rid has {len(rids)} entries for {len(prompts)} prompts")
        groups = [engine.submit(ids, req.sampling_params, rid) for ids, rid in zip(prompts, rids)]
        finished = await asyncio.gather(*(asyncio.wrap_future(s.future) for g in groups for s in g))
        out = [_response(s, req, engine, return_routed_experts).model_dump(exclude_none=True) for s in finished]
        return out if req.is_batch or req.sampling_params.n > 1 else out[0]

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if engine.busy:
            return _error(400, "cannot flush the cache while requests are running: pause first")
        return {"success": True, "message": "cache flushed"}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        req = await _parse(request, p.AbortReqInput)
        count = engine.abort(req.rid, req.abort_all)
        return {"success": True, "message": f"aborted {count} sequences"}

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        req = await _parse(request, p.PauseGenerationReqInput)
        await asyncio.to_thread(engine.pause, req.mode)  # returns when the engine stands between steps
        return {"success": True, "message": f"paused ({req.mode})"}

    @app.post("/continue_generation")
    async def continue_generation():
        engine.resume()
        return {"success": True, "message": "continued"}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        req = await _parse(request, p.UpdateWeightVersionReqInput)
        engine.weight_version = req.new_version
        return {"success": True, "message": f"weight version {req.new_version}"}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        req = await _parse(request, p.InitWeightsUpdateGroupReqInput)
        if req.backend == "nccl" and not torch.cuda.is_available():
            raise EngineError("backend nccl needs CUDA; the CPU engine joins with backend gloo")
        group = await asyncio.to_thread(
            open_group,
            req.master_address,
            req.master_port,
            req.rank_offset,
            req.world_size,
            req.group_name,
            req.backend,
        )
        updates.groups[req.group_name] = group
        return {"success": True, "message": f"joined {req.group_name} as rank {req.rank_offset}"}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        req = await _parse(request, p.DestroyWeightsUpdateGroupReqInput)
        if updates.groups.pop(req.group_name, None) is None:
            raise EngineError(f"no weight update group named {req.group_name!r}")
        return {"success": True, "message": f"left {req.group_name}"}

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        await _parse(request, p.BeginWeightUpdateReqInput)
        updates.session = {"failed": None, "version": None}
        return {"success": True, "message": "weight update session open"}

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        await _parse(request, p.EndWeightUpdateReqInput)
        session, updates.session = updates.session, None
        if session is None:
            raise EngineError("no weight update session is open (call /begin_weight_update)")
        if session["failed"]:
            raise EngineError(
                f"weight update failed ({session['failed']}); keeping weight version {engine.weight_version}"
            )
        if session["version"] is not None:
            engine.weight_version = session["version"]
        return {"success": True, "message": f"weight version {engine.weight_version}"}

    @app.post("/get_weights_by_name")
    async def get_weights_by_name(request: Request):
        req = await _parse(request, p.GetWeightsByNameReqInput)
        if "weights" in engine.released:
            raise EngineError("weights are released: resume them (/resume_memory_occupation) first")
        if req.name not in engine.weights:
            raise EngineError(f"unknown weight name {req.name!r}")
        with engine.model_lock:
            return engine.weights[req.name][: req.truncate_size].float().tolist()

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        req = await _parse(request, p.UpdateWeightsFromDistributedReqInput)
        if updates.session is None:
            raise EngineError("updates must be inside /begin_weight_update … /end_weight_update")
        try:
            await _receive_and_apply(req, updates)
        except EngineError as err:
            updates.session["failed"] = str(err)
            raise
        updates.session["version"] = req.weight_version or updates.session["version"]
        return {"success": True, "message": f"updated {len(req.names)} tensors"}

    add_chat_endpoint(app, engine, _parse)  # /v1/chat/completions, as SGLang's OpenAI-compatible API
    return app


async def _receive_and_apply(req: p.UpdateWeightsFromDistributedReqInput, updates: WeightUpdates) -> None:
    """Receives one update (a flattened bucket or per-tensor broadcasts) and loads it."""
    engine = updates.engine
    group = updates.groups.get(req.group_name)
    if group is None:
        raise EngineError(f"no weight update group named {req.group_name!r}: call /init_weights_update_group first")
    if req.abort_all_requests:
        engine.abort(abort_all=True)
    try:
        dtypes = [dtype_from_name(d) for d in req.dtypes]
        if req.load_format == "flattened_bucket":
            tensors = await asyncio.to_thread(receive_bucket, group, dtypes, req.shapes, req.checksum)
        else:
            tensors = await asyncio.to_thread(receive_tensors, group, dtypes, req.shapes)
    except ValueError as err:  # unknown dtype, unaligned layout, checksum mismatch
        raise EngineError(f"weights not loaded: {err}") from err
    # refusals come only after the broadcast is drained: a sender never blocks on an engine
    updates.check_version(req.weight_version)
    updates.apply(req.names, tensors)
    if req.flush_cache and engine.busy:
        raise EngineError("weights loaded, but the cache flush failed: requests are running")


def _prompts(req: p.GenerateReqInput, engine: CpuEngine) -> list[list[int]]:
    if req.input_ids is not None:  # is_batch says which of the two shapes it is
        return cast(list[list[int]], req.input_ids) if req.is_batch else [cast(list[int], req.input_ids)]
    if engine.tokenizer is None:
        raise EngineError("text: this model has no tokenizer; send input_ids")
    texts = req.text if isinstance(req.text, list) else [cast(str, req.text)]  # one of the two is given
    return [engine.tokenizer.encode(t) for t in texts]


def _response(seq: Sequence, req: p.GenerateReqInput, engine: CpuEngine, routed_enabled: bool) -> p.GenerateResponse:
    text = engine.tokenizer.decode(seq.output_ids) if engine.tokenizer is not None else ""
    meta = p.MetaInfo(
        id=seq.rid,
        finish_reason=seq.finish,
        prompt_tokens=len(seq.prompt_ids),
        completion_tokens=len(seq.output_ids),
        weight_version=engine.weight_version,
        weight_versions=_version_spans(seq.versions),
        e2e_latency=time.monotonic() - seq.started,
    )
    if req.return_logprob:
        meta.output_token_logprobs = [[lp, tok, None] for lp, tok in zip(seq.logprobs, seq.output_ids)]
    if req.return_routed_experts and routed_enabled and seq.routing:
        import numpy as np

        meta.routed_experts = encode_routed_experts(np.stack(seq.routing)[req.routed_experts_start_len :])
    return p.GenerateResponse(text=text, output_ids=seq.output_ids, meta_info=meta)


def _bearer_matches(request: Request, api_key: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), api_key.encode())


def _newer(current: str, candidate: str) -> bool | None:
    """Whether candidate is a newer version than current (None when not comparable)."""
    if current.lstrip("-").isdigit() and candidate.lstrip("-").isdigit():
        return int(candidate) > int(current)
    return None


def _version_spans(versions: list[str]) -> list[dict]:
    """SGLang's weight_versions: which output token span each weight version produced."""
    spans: list[dict] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """The server runs in its own session (so it can be stopped as a group); if whoever
    started it dies without stopping it, it must not outlive them as an orphan."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="megatron-rlvr CPU engine (SGLang HTTP API)")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    parser.add_argument("--weight-version", default="0")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true", help="released weights come back intact")
    parser.add_argument("--threads", type=int, default=1, help="torch threads: one per core the engine is pinned to")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    _exit_with_parent()
    engine = CpuEngine(
        args.model_path, dtype=args.dtype, max_batch=args.max_running_requests, weight_version=args.weight_version
    )
    app = create_app(
        engine,
        return_routed_experts=args.enable_return_routed_experts,
        api_key=os.environ.pop(ENGINE_API_KEY_ENV, None),
        weights_cpu_backup=args.enable_weights_cpu_backup,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
