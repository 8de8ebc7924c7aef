"""vLLM's own scheduler and request objects for the connector's unit tests (no model run).

``make_scheduler`` builds a real ``vllm.v1.core.sched.scheduler.Scheduler`` whose connector
is ``RD2HConnector`` (found through the entry point), over a config-only tiny Llama; the
tests play the workers by answering each step with a ``ModelRunnerOutput``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "max_position_embeddings": 512, "torch_dtype": "float32", "bos_token_id": 1,
    "eos_token_id": 2, "rms_norm_eps": 1e-6,
}
BLOCK = 32
SECRET = b"rd2h-unit-test-secret-0123456789"  # what the proxy and the engines share in these tests
METASERVER = "http://proxy/rdv"


def write_model(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(LLAMA))
    return directory


class Posts:
    """A metaserver stand-in for the rendezvous poster: records what was posted."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.posted = threading.Event()

    def __call__(self, url: str, body: Any) -> int:
        self.bodies.append({"url": url, **body})
        self.posted.set()
        return 200


def _extra(model: Path, role: str, extra: dict | None) -> dict[str, Any]:
    """The connector's config: the shared secret (in a file) and, for Decode, the metaserver."""
    secret = model / "rd2h.secret"
    secret.write_bytes(SECRET)
    base: dict[str, Any] = {"secret_file": str(secret)}
    if role != "kv_producer":
        base["metaserver"] = METASERVER
    return {**base, **(extra or {})}


def engine_config(
    model: Path, role: str | None = None, *, extra: dict | None = None, batched: int = 128,
    prefix_caching: bool = True, connector: str = "RD2HConnector", load_failure_policy: str = "fail",
    parallel: dict | None = None, **scheduler: Any,
) -> Any:
    """A ``VllmConfig`` over ``model`` on CPU, blocks of ``BLOCK`` tokens; ``role``: rd2h's
    connector (``extra``: its config) or none; ``scheduler``: more ``SchedulerConfig`` fields."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    transfer = None
    if role is not None:
        transfer = KVTransferConfig(kv_connector=connector, kv_role=role,
                                    kv_connector_extra_config=_extra(model, role, extra),
                                    kv_load_failure_policy=load_failure_policy)  # fmt: skip
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                                 enforce_eager=True),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=batched, max_model_len=512,
                                         enable_chunked_prefill=True, is_encoder_decoder=False, **scheduler),
        parallel_config=ParallelConfig(**(parallel or {})), kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )  # fmt: skip
    config.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves on CPU
    return config


def make_scheduler(
    model: Path, role: str, *, num_blocks: int = 64, batched: int = 128, extra: dict | None = None,
    connector: str = "RD2HConnector", prefix_caching: bool = True, load_failure_policy: str = "fail",
):
    import torch
    from vllm.plugins import load_general_plugins
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    load_general_plugins()  # as every vLLM process does: our entry point registers the connector
    config = engine_config(model, role, extra=extra, batched=batched, prefix_caching=prefix_caching,
                           connector=connector, load_failure_policy=load_failure_policy)  # fmt: skip
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], spec)],
    )
    scheduler = Scheduler(config, kv_cache_config=kv_config, structured_output_manager=StructuredOutputManager(config),
                          block_size=BLOCK, log_stats=False)
    return scheduler, record_posts(scheduler)


def record_posts(scheduler: Any) -> Posts:
    """The rd2h scheduler's real rendezvous poster (if it has one), its metaserver replaced by a
    :class:`Posts` that records what it posts."""
    from rd2h.vllm.rendezvous import RendezvousPoster

    posts = Posts()
    ours = getattr(scheduler.connector, "scheduler", None)
    if ours is not None and ours._poster is not None:
        ours._poster.close()
        ours._poster = RendezvousPoster(post=posts)
    return posts


def make_request(req_id: str, tokens: int, params: dict[str, Any], *, max_tokens: int = 8, seed: int = 0):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args={"kv_transfer_params": params})
    prompt = [(seed * 31 + i * 7) % 997 + 3 for i in range(tokens)]
    return Request(req_id, prompt, sampling, None, block_hasher=get_request_block_hasher(BLOCK, sha256))


def runner_output(scheduler_output: Any, *, sampled: dict[str, int] | None = None, **kv: Any):
    """What the workers would return for ``scheduler_output``: one token for each request
    in ``sampled`` (a request in its last prefill chunk), and ``kv`` as KVConnectorOutput."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = sampled or {}
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in req_ids],
        kv_connector_output=KVConnectorOutput(**kv) if kv else None,
    )
