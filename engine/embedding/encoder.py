"""Embeddings: a sentence-transformers-style encoder run in length-sorted, token-budgeted batches.

A model directory is a local Hugging Face encoder with sentence-transformers' module files
(``modules.json``, ``1_Pooling/config.json``, optionally ``Normalize``); pooling and
normalisation follow them, so the vectors are the model's own. :func:`plan_batches` sorts the
inputs by length and cuts batches whose padded size fits ``max_batch_tokens``; outputs come
back in input order. Why: docs/engine.md ("Embeddings").
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_POOLING_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "last",
}

EmbeddingInput = str | Sequence[int]


class EmbeddingError(ValueError):
    """One input (or option) the model cannot embed; ``param`` names the field."""

    def __init__(self, message: str, param: str = "input", code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class Pooling:
    """How token states become one vector: from sentence-transformers' module files."""

    mode: str = "mean"
    normalize: bool = False
    max_seq_length: int | None = None
    # Output sizes the model was trained to be cut to (Matryoshka); empty: only its full size.
    truncate_dims: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Pooling:
        root = Path(model_dir)
        modules_file = root / "modules.json"
        if not modules_file.is_file():
            raise ValueError(
                f"{root} has no modules.json: not a sentence-transformers model directory "
                "(its pooling is unknown)"
            )
        modules = json.loads(modules_file.read_text())
        kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
        if "Pooling" not in kinds:
            raise ValueError(f"{root}/modules.json names no Pooling module")
        pooling_cfg = json.loads(
            (root / kinds["Pooling"].get("path", "") / "config.json").read_text()
        )
        modes = [mode for key, mode in _POOLING_MODES.items() if pooling_cfg.get(key)]
        if len(modes) != 1:
            raise ValueError(
                f"{root}: pooling modes {modes or 'none'} — one of {sorted(_POOLING_MODES)} "
                "must be set"
            )
        unsupported = set(kinds) - {"Transformer", "Pooling", "Normalize"}
        if unsupported:
            raise ValueError(
                f"{root}: unsupported sentence-transformers modules {sorted(unsupported)}"
            )
        st_cfg = root / "sentence_bert_config.json"
        max_len = json.loads(st_cfg.read_text()).get("max_seq_length") if st_cfg.is_file() else None
        dims: tuple[int, ...] = ()
        extra = root / "config_sentence_transformers.json"
        if extra.is_file():
            dims = tuple(int(d) for d in json.loads(extra.read_text()).get("matryoshka_dims") or ())
        return cls(modes[0], "Normalize" in kinds, max_len, dims)


@dataclass(slots=True)
class EmbeddingOutput:
    """One input's vector (float32, on the CPU) and its token count."""

    embedding: torch.Tensor
    num_tokens: int


@dataclass(slots=True)
class EmbeddingStats:
    inputs: int = 0
    tokens: int = 0  # real tokens embedded
    padded_tokens: int = 0  # tokens the model ran, padding included
    batches: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / self.padded_tokens if self.padded_tokens else 0.0


def plan_batches(
    lengths: Sequence[int], max_batch_tokens: int, max_batch_size: int, *, sort: bool = True
) -> list[list[int]]:
    """Cut input indices into batches whose padded size (``len * longest``) fits the budget.

    ``sort`` (the default) groups inputs of similar length, longest first; without it batches
    take the inputs in arrival order (the baseline the benchmark compares with). An input
    longer than the budget on its own still gets a batch of one.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if sort else range(len(lengths))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        grown = max(longest, lengths[i])
        if current and (
            len(current) >= max_batch_size or grown * (len(current) + 1) > max_batch_tokens
        ):
            batches.append(current)
            current, grown = [], lengths[i]
        current.append(i)
        longest = grown
    if current:
        batches.append(current)
    return batches


class EmbeddingEngine:
    """Embeds many inputs at once: ``EmbeddingEngine(path).embed(["a", "b"])``."""

    def __init__(
        self,
        model: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_batch_tokens: int = 16384,
        max_batch_size: int = 512,
        max_model_len: int | None = None,
        sort_by_length: bool = True,
    ) -> None:
        from transformers import AutoModel, AutoTokenizer

        from engine.core.model_runner import resolve_device, resolve_dtype

        self.device = resolve_device(device)
        # Vectors keep float32 on a CPU (auto): bf16 moves every coordinate by up to 2^-8.
        self.dtype = resolve_dtype(dtype, self.device, cpu_bf16=False)
        self.pooling = Pooling.from_dir(model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.model = AutoModel.from_pretrained(str(model), dtype=self.dtype).to(self.device).eval()
        config = self.model.config
        limit = getattr(config, "max_position_embeddings", None)
        if max_model_len is not None and limit is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {limit} positions")
        self.max_model_len = max_model_len or self.pooling.max_seq_length or limit or 512
        self.dimension = int(config.hidden_size)
        if max_batch_tokens < self.max_model_len:
            raise ValueError(
                f"max_batch_tokens {max_batch_tokens} cannot hold one input of "
                f"max_model_len {self.max_model_len}"
            )
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.sort_by_length = sort_by_length
        self.pad_id = self.tokenizer.pad_token_id or 0
        self._prefix, self._suffix = _special_tokens(self.tokenizer)
        self.stats = EmbeddingStats()

    # -- inputs ---------------------------------------------------------------------------------

    def token_ids(self, item: EmbeddingInput, index: int = 0) -> list[int]:
        """The ids the model sees for one input (special tokens added); refuses what it cannot
        embed with an error naming the input and the limit."""
        where = f"input[{index}]"
        if isinstance(item, str):
            if not item:
                raise EmbeddingError(f"{where} is an empty string; it has nothing to embed", where)
            ids = self.tokenizer(item, add_special_tokens=True)["input_ids"]
        else:
            ids = list(item)
            if not ids:
                raise EmbeddingError(f"{where} is an empty token array", where)
            vocab = self.model.config.vocab_size
            bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise EmbeddingError(
                    f"{where} holds token id {bad!r}, outside the vocabulary [0, {vocab})", where
                )
            ids = self.with_special_tokens(ids)
        if len(ids) > self.max_model_len:
            raise EmbeddingError(
                f"{where} is {len(ids)} tokens, over this model's maximum input length of "
                f"{self.max_model_len} tokens",
                where,
                code="context_length_exceeded",
            )
        return ids

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        """Token ids as the tokenizer would frame a text (e.g. BERT's ``[CLS] … [SEP]``)."""
        return [*self._prefix, *ids, *self._suffix]

    def check_dimensions(self, dimensions: int | None) -> int:
        """The output size for a request's ``dimensions`` (OpenAI's parameter)."""
        if dimensions is None or dimensions == self.dimension:
            return self.dimension
        if dimensions in self.pooling.truncate_dims:
            return dimensions
        allowed = sorted({*self.pooling.truncate_dims, self.dimension})
        raise EmbeddingError(
            f"This model does not support dimensions={dimensions}; supported: {allowed}",
            param="dimensions",
        )

    # -- running --------------------------------------------------------------------------------

    def embed(
        self, inputs: Sequence[EmbeddingInput], dimensions: int | None = None
    ) -> list[EmbeddingOutput]:
        """Embed every input; the outputs are in input order."""
        size = self.check_dimensions(dimensions)
        ids = [self.token_ids(item, i) for i, item in enumerate(inputs)]
        return self.embed_ids(ids, size)

    @torch.inference_mode()
    def embed_ids(
        self, ids: Sequence[Sequence[int]], dimensions: int | None = None
    ) -> list[EmbeddingOutput]:
        """Embed already tokenized inputs (as :meth:`token_ids` makes them), in input order."""
        size = dimensions or self.dimension
        start = time.perf_counter()
        lengths = [len(x) for x in ids]
        out: list[EmbeddingOutput | None] = [None] * len(ids)
        plan = plan_batches(
            lengths, self.max_batch_tokens, self.max_batch_size, sort=self.sort_by_length
        )
        for batch in plan:
            vectors = self._forward([ids[i] for i in batch], size)
            for row, i in enumerate(batch):
                out[i] = EmbeddingOutput(vectors[row], lengths[i])
            self.stats.padded_tokens += len(batch) * max(lengths[i] for i in batch)
        self.stats.inputs += len(ids)
        self.stats.tokens += sum(lengths)
        self.stats.batches += len(plan)
        self.stats.seconds += time.perf_counter() - start
        return out  # type: ignore[return-value]

    def _forward(self, batch: list[Sequence[int]], size: int) -> torch.Tensor:
        longest = max(len(x) for x in batch)
        input_ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, x in enumerate(batch):
            input_ids[row, : len(x)] = torch.as_tensor(x, dtype=torch.long)
            mask[row, : len(x)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        vectors = pool(hidden.float(), mask, self.pooling.mode)[:, :size]
        if self.pooling.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=-1)
        return vectors.cpu()


def _special_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text's own ids."""
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    framed = tokenizer("x", add_special_tokens=True)["input_ids"]
    for at in range(len(framed) - len(plain) + 1):
        if framed[at : at + len(plain)] == plain:
            return framed[:at], framed[at + len(plain) :]
    return [], []


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """sentence-transformers' pooling of ``hidden`` ``[B, T, H]`` over the ``mask`` ``[B, T]``."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "last":
        return hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]
    if mode == "max":
        return hidden.masked_fill(m == 0, float("-inf")).max(1).values
    summed = (hidden * m).sum(1)
    count = m.sum(1).clamp(min=1e-9)
    return summed / (count.sqrt() if mode == "mean_sqrt_len" else count)
