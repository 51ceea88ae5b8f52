"""Loads a Hugging Face causal LM, owns its paged KV cache and runs one packed step."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.attention import paged as attention
from engine.attention.flex import FlexBackend, build_step, to_device
from engine.attention.paged import AttentionContext, DecodeGroup, PrefillChunk
from engine.attention.sdpa import SdpaBackend
from engine.core import memory
from engine.core.config import EngineConfig
from engine.core.sequence import Sequence
from engine.core.step import StepBatch
from engine.cpu import linear as cpu_linear
from engine.forward import fusion
from engine.forward.llama import LeanLlama
from engine.lora import layers as lora_layers
from engine.lora.manager import LoraManager

log = logging.getLogger("engine")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_supports_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX tiles or AVX-512 BF16): there a bf16
    matmul runs several times faster than a float32 one; elsewhere bf16 is emulated."""
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        supported = getattr(torch.cpu, probe, None)
        if supported is not None and supported():
            return True
    return False


def resolve_dtype(name: str, device: torch.device, *, cpu_bf16: bool = True) -> torch.dtype:
    """``auto``: bf16 on an accelerator, and on a CPU that multiplies bf16 natively unless
    ``cpu_bf16`` is False; float32 otherwise."""
    if name == "auto":
        if device.type == "cuda" or (cpu_bf16 and device.type == "cpu" and cpu_supports_bf16()):
            return torch.bfloat16
        return torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, model: str, config: EngineConfig) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        name = attention.register()
        self.backend_name = attention.resolve_backend(config.attention_backend, self.device)
        self.backend = (
            FlexBackend() if self.backend_name == "flex" else SdpaBackend(config.cpu_kernels)
        )
        hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=self.dtype)
        memory.return_free_heap()  # the checkpoint's converted copies
        hf_model.to(self.device).eval()
        hf_model.set_attn_implementation(name)
        self.model = hf_model
        self.base = getattr(hf_model, hf_model.base_model_prefix)
        self.lm_head = hf_model.get_output_embeddings()
        rows = config.max_num_seqs or 64
        # The linear weights as loaded: those that fusing or packing replaces are let go below.
        loaded = [m.weight for m in self.base.modules() if type(m) is torch.nn.Linear]
        # The layers a LoRA adapter may adapt, by their path in the model as loaded.
        linears = {
            name: (m.in_features, m.out_features)
            for name, m in hf_model.named_modules()
            if type(m) is torch.nn.Linear and m is not self.lm_head
        }
        if self.device.type == "cpu" and config.cpu_kernels:
            log.info("%d projection sets fused (CPU)", fusion.fuse_projections(self.base))
            self._let_go(loaded)  # before packing makes its copies: a lower peak
        packing: str | None = None  # what the linear layers were packed for, if they were
        if cpu_linear.packable(self.dtype, self.device):
            head = self.lm_head
            plain_head = type(head) is torch.nn.Linear
            body = cpu_linear.largest_linear(self.base)
            # bf16 packs for oneDNN (AMX, AVX-512 BF16); float32 for the library this machine
            # recorded as fastest, if any pays; EngineConfig.cpu_gemm may force one.
            gemm, compiled = config.cpu_gemm, config.cpu_kernels
            kind = (
                cpu_linear.choose_packing(body, rows, gemm, compiled) if body is not None else None
            )
            packed = cpu_linear.pack_linears(self.base, rows, kind) if kind else 0
            packing = kind if packed else None
            head_kind = None
            if plain_head and (packed or self.dtype == torch.float32):
                head_kind = cpu_linear.choose_packing(head, rows, gemm, compiled)
            if head_kind is not None:
                # A copy: the output layer may share its weight with the input embedding.
                self.lm_head = cpu_linear.PackedLinear.of(head, rows, head_kind)
            log.info(
                "%d linear layers packed (%s, %s on CPU), output layer %s",
                packed,
                kind if packed else "none",
                self.dtype,
                head_kind or "plain",
            )
        self._let_go(loaded)
        del loaded
        self.lora_state = lora_layers.LoraState()
        self.loras = LoraManager(
            linears,
            self._attach_loras,
            max_loras=config.max_loras,
            max_rank=config.max_lora_rank,
            dtype=self.dtype,
            device=self.device,
            rows_hint=rows,
            packing=packing,
        )
        self.lean: LeanLlama | None = None
        specs = [self.loras.register(n, d) for n, d in config.lora_adapters.items()]
        self._build_lean()
        text_config = hf_model.config.get_text_config()
        attention.check_config(text_config)
        self.model_config = text_config
        self.num_layers = text_config.num_hidden_layers
        self.num_kv_heads = (
            getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        )
        self.head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        self.softcap = getattr(text_config, "final_logit_softcapping", None)
        self.vocab_size = text_config.vocab_size
        limit = getattr(text_config, "max_position_embeddings", None)
        if config.max_model_len is not None and limit is not None and config.max_model_len > limit:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        self.max_model_len = config.max_model_len or limit or 2048
        self.block_size = config.block_size
        self.num_blocks = self._num_blocks(self.loras.reserve_bytes(specs))
        if specs:
            log.info(
                "LoRA: %d adapters registered, at most %d resident (%.1f MiB off the KV budget)",
                len(specs),
                config.max_loras,
                self.loras.reserved_bytes / 2**20,
            )
        slots = self.num_blocks * self.block_size
        # One block past those the block manager hands out: a scratch block that the load-time
        # probe and the padding rows of a CUDA graph write to, never read by a real sequence.
        self.scratch_block = self.num_blocks
        # The layout the attention reads (engine/attention/paged.py): a KV head's block is contiguous.
        shape = (self.num_kv_heads, self.num_blocks + 1, self.block_size, self.head_dim)
        self.k_cache = [
            memory.zeros(shape, self.dtype, self.device) for _ in range(self.num_layers)
        ]
        self.v_cache = [
            memory.zeros(shape, self.dtype, self.device) for _ in range(self.num_layers)
        ]
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB) on %s, dtype %s",
            self.num_blocks,
            self.block_size,
            slots,
            self.bytes_per_block * self.num_blocks / 2**20,
            self.device,
            self.dtype,
        )
        self.graphs = None
        memory.return_free_heap()  # the weights that fusing and packing replaced
        self._probe()
        if config.cuda_graphs and self.device.type == "cuda" and self.backend_name == "flex":
            from engine.core.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self, config.cuda_graph_max_batch)
        log.info("attention backend %s, CUDA graphs %s", self.backend_name, self.graphs is not None)

    def _build_lean(self) -> None:
        """transformers' Llama layers without their per-layer Python, where the model is one."""
        config = self.config
        self.lean = (
            LeanLlama.of(self.base)
            if self.device.type == "cpu" and config.cpu_kernels and self.backend_name == "sdpa"
            else None
        )

    def _attach_loras(self) -> dict:
        """Wrap the adaptable linear layers (at the first adapter registered): the lean forward
        is built again over the wrapped layers."""
        sites = lora_layers.attach(self.model, self.loras.linears, self.lora_state)
        if self.lean is not None:
            self._build_lean()
        log.info("LoRA: %d linear sites wrapped", len(sites["sites"]))
        return sites

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def _let_go(self, loaded: list[torch.Tensor]) -> None:
        """Drop the checkpoint-file pages of the ``loaded`` weights the model no longer holds."""
        live = {t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers())}
        memory.drop_file_pages([w for w in loaded if w.data_ptr() not in live])

    def _num_blocks(self, lora_bytes: int = 0) -> int:
        """KV blocks for this device: ``num_kv_blocks`` if set, else the memory budget
        (engine/core/memory.py: on an accelerator, a fraction of the memory left free by the
        weights and by a profiling forward at ``max_num_batched_tokens``), less what the
        resident LoRA adapters may take (``lora_bytes``)."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        free: int | None = None
        peak = 0
        describe = f" (kv_cache_memory {cfg.kv_cache_memory!r})"
        if isinstance(cfg.kv_cache_memory, float) and self.device.type == "cuda":
            peak = memory.profile_activation_peak(
                self.model,
                num_tokens=cfg.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                num_sampled=cfg.resolved_max_num_seqs,
                device=self.device,
            )
            free, _ = torch.cuda.mem_get_info(self.device)
            describe = (
                f" (kv_cache_memory {cfg.kv_cache_memory!r} of {free / 2**20:.0f} MiB free "
                f"less a {peak / 2**20:.0f} MiB activation peak)"
            )
        budget = memory.kv_budget_bytes(
            cfg.kv_cache_memory, free_bytes=free, activation_peak_bytes=peak
        )
        budget -= self.bytes_per_block  # the scratch block (see __init__)
        budget -= lora_bytes  # max_loras resident adapters (engine/lora/manager.py)
        budget -= memory.kernel_scratch_bytes(  # the compiled kernels' (engine/cpu/kernels.py)
            self.backend,
            kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        return memory.num_kv_blocks(
            budget,
            bytes_per_block=self.bytes_per_block,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=cfg.resolved_max_num_seqs,
            describe=describe,
        )

    # -- one step -------------------------------------------------------------------------------

    def _probe(self) -> None:
        """One token through the model at load, written to the scratch block: a model whose
        attention passes something the backend does not implement fails here, by name."""
        probe = _ProbeSeq([0], [self.scratch_block])
        self.forward(self.prepare([(probe, 1)]))  # type: ignore[list-item]

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> StepBatch:
        decodes = []
        prefills = []
        for seq, n in scheduled:
            if n == 1 and seq.num_computed_tokens == len(seq) - 1:
                decodes.append(seq)
            else:
                prefills.append((seq, n))
        if self.loras.resident:  # each adapter's prefill chunks side by side (LoraStep)
            prefills.sort(key=_adapter_of)
        if self.backend_name == "flex":
            return self._prepare_flex(decodes, prefills)
        return self._prepare_sdpa(decodes, prefills)

    def _prepare_flex(
        self, decodes: list[Sequence], prefills: list[tuple[Sequence, int]]
    ) -> StepBatch:
        """Pack the step with a fixed number of tensor ops, whatever the number of sequences."""
        bs = self.block_size
        packed = _Packed.of(decodes, prefills, bs)
        tables = [seq.block_table[: -(-end // bs)] for seq, _, end in packed.parts]
        q_seq = [i for i, (_, c0, end) in enumerate(packed.parts) for _ in range(end - c0)]
        positions = to_device(packed.positions, torch.long, self.device)
        ctx = AttentionContext(
            self.k_cache,
            self.v_cache,
            to_device(packed.slots, torch.long, self.device),
            self.backend,
            flex=build_step(tables, q_seq, positions, self.num_blocks + 1, bs, self.device),
        )
        return self._step(packed, ctx, positions)

    def _step(self, packed: _Packed, ctx: AttentionContext, positions: torch.Tensor) -> StepBatch:
        batch = packed.step(ctx, positions, self.device)
        if self.loras.resident:
            batch.lora = self.loras.step_for(packed.parts)
        return batch

    def _prepare_sdpa(
        self, decodes: list[Sequence], prefills: list[tuple[Sequence, int]]
    ) -> StepBatch:
        """Pack the step: decodes first, sorted by length and cut into groups attended
        together; then each prefill chunk, attended on its own."""
        bs = self.block_size
        dev = self.device
        decodes = sorted(decodes, key=len)
        packed = _Packed.of(decodes, prefills, bs)
        ctx = AttentionContext(
            self.k_cache, self.v_cache, to_device(packed.slots, torch.long, dev), self.backend
        )
        start = 0
        for end in _decode_groups([(len(seq) - 1) // bs + 1 for seq in decodes]):
            group = decodes[start:end]
            width = (len(group[-1]) - 1) // bs + 1
            rows = [seq.block_table[: (len(seq) - 1) // bs + 1] for seq in group]
            blocks = [r + [self.scratch_block] * (width - len(r)) for r in rows]
            ctx.decodes.append(
                DecodeGroup(
                    start,
                    end,
                    torch.tensor(blocks, dtype=torch.long, device=dev),
                    torch.tensor([len(seq) for seq in group], dtype=torch.long, device=dev),
                    bs,
                    [len(seq) for seq in group],
                )
            )
            start = end
        offset = len(decodes)
        for seq, c0, end in packed.parts[len(decodes) :]:
            chunk = PrefillChunk(offset, offset + end - c0, first_pos=c0)
            if c0 > 0:
                chunk.context_len = end
                chunk.blocks = torch.tensor(
                    seq.block_table[: -(-end // bs)], dtype=torch.long, device=dev
                )
            ctx.prefills.append(chunk)
            offset += end - c0
        return self._step(packed, ctx, to_device(packed.positions, torch.long, dev))

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Run the model on the packed step; return float32 logits of the sampled rows."""
        graphable = batch.lora is None and not batch.ctx.prefills
        if self.graphs is not None and graphable and batch.ctx.flex is not None:
            logits = self.graphs.run(batch)
            if logits is not None:
                return logits
        return self.eager_forward(batch)

    def eager_forward(self, batch: StepBatch) -> torch.Tensor:
        if batch.lora is None:
            return self._eager_forward(batch)
        self.lora_state.step = batch.lora  # read by every wrapped linear layer
        try:
            return self._eager_forward(batch)
        finally:
            self.lora_state.step = None

    def _eager_forward(self, batch: StepBatch) -> torch.Tensor:
        if self.lean is not None:
            hidden = self.lean(batch.input_ids, batch.positions, batch.ctx)
        else:
            hidden = self.base(
                input_ids=batch.input_ids.unsqueeze(0),
                position_ids=batch.positions.unsqueeze(0),
                use_cache=False,
                batchd_ctx=batch.ctx,
            ).last_hidden_state[0]
        return self.logits(hidden.index_select(0, batch.sample_rows))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of hidden rows, final soft-capping (Gemma-2) applied."""
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@dataclass(slots=True)
class _Packed:
    """A step's tokens packed without padding: decodes first, then prefill chunks, each part
    ``(seq, first position, end)``; the rows to sample are the last token of each sequence
    whose part reaches its end."""

    parts: list[tuple[Sequence, int, int]]
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_seqs: list[Sequence] = field(default_factory=list)

    @classmethod
    def of(
        cls, decodes: list[Sequence], prefills: list[tuple[Sequence, int]], block_size: int
    ) -> _Packed:
        parts = [(seq, len(seq) - 1, len(seq)) for seq in decodes]
        parts += [
            (seq, seq.num_computed_tokens, seq.num_computed_tokens + n) for seq, n in prefills
        ]
        packed = cls(parts)
        bs = block_size
        for seq, c0, end in parts:
            table = seq.block_table
            packed.ids.extend(seq.token_ids[c0:end])
            packed.positions.extend(range(c0, end))
            packed.slots.extend(table[p // bs] * bs + p % bs for p in range(c0, end))
            if end == len(seq):
                packed.sample_rows.append(len(packed.ids) - 1)
                packed.sample_seqs.append(seq)
        return packed

    def step(
        self, ctx: AttentionContext, positions: torch.Tensor, device: torch.device
    ) -> StepBatch:
        return StepBatch(
            input_ids=to_device(self.ids, torch.long, device),
            positions=positions,
            ctx=ctx,
            sample_rows=to_device(self.sample_rows, torch.long, device),
            sample_seqs=self.sample_seqs,
            num_tokens=len(self.ids),
        )


def _adapter_of(part: tuple[Sequence, int]) -> str:
    request = getattr(part[0], "request", None)  # the load-time probe has none
    lora = request.lora if request is not None else None
    return "" if lora is None else "\0" + lora


def _decode_groups(num_blocks: list[int]) -> list[int]:
    """Cut decodes sorted by their number of blocks into groups attended together; return each
    group's end. A group grows while padding to its longest costs little: a new one starts
    where a sequence needs both over 1.5x and over 8 more blocks than the group's first."""
    ends: list[int] = []
    first = num_blocks[0] if num_blocks else 0
    for i, nb in enumerate(num_blocks):
        if nb > 1.5 * first and nb - first > 8:
            ends.append(i)
            first = nb
    if num_blocks:
        ends.append(len(num_blocks))
    return ends


class _ProbeSeq:
    """The least of a sequence that ``prepare`` reads: a prompt not yet computed."""

    def __init__(self, token_ids: list[int], block_table: list[int]) -> None:
        self.token_ids = token_ids
        self.block_table = block_table
        self.num_computed_tokens = 0

    def __len__(self) -> int:
        return len(self.token_ids)
